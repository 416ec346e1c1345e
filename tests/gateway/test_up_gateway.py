"""``plexrl up --gateway``: everything on one machine behind the HTTP gateway, no demo runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from gateway_support import REPO, free_port

from services.model.tiny import build_tiny_model

pytestmark = pytest.mark.timeout(300)


def test_up_with_the_gateway_serves_until_stopped(tmp_path) -> None:
    model = build_tiny_model(tmp_path / "model", seed=0)
    port = free_port()
    log = (tmp_path / "up.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "services", "up", "--gateway", "--gateway-port", str(port)),
            *("--model", str(model), "--output-dir", str(tmp_path / "out"), "--no-live"),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=90)
        models = [m.id for m in client.models.list()]
        assert models == [str(model)]  # the base model only: no demo runs were started
        made = client.completions.create(model=str(model), prompt="ab", max_tokens=3)
        assert len(made.choices) == 1
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, (tmp_path / "up.log").read_text()
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
    out = (tmp_path / "up.log").read_text()
    assert f"gateway: {url}" in out
    assert not list((tmp_path / "out").glob("run_*/metrics.jsonl"))
