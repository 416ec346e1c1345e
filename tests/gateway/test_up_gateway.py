"""``plexrl up --gateway``: everything on one machine behind the HTTP gateway, no demo runs; its
run slots come back when Tinker sessions end, however they end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import tinker
from gateway_support import REPO, free_port
from tinker import types

from services.model.loader import load_tokenizer
from services.model.tiny import build_tiny_model

pytestmark = pytest.mark.timeout(300)
NAME = "plexrl/tiny-char"


def _wait(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_up_with_the_gateway_serves_until_stopped_and_gives_slots_back(tmp_path) -> None:
    model = build_tiny_model(tmp_path / "model", seed=0)
    tok = load_tokenizer(model)
    port = free_port()
    log = (tmp_path / "up.log").open("wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    # sessions silent for 15 s end; a client waits 5 s for a slot at most
    env |= {"PLEXRL_SESSION_TTL_S": "15", "PLEXRL_CREATE_TIMEOUT_S": "5"}
    up = subprocess.Popen(
        [
            *(sys.executable, "-m", "services", "up", "--gateway", "--gateway-port", str(port)),
            *("--model", str(model), "--output-dir", str(tmp_path / "out"), "--no-live"),
            *("--max-runs", "2", "--model-name", NAME),
        ],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert up.poll() is None, (tmp_path / "up.log").read_text()
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def active() -> set[str]:
        return {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]} - {NAME}

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 10, 11]),
        loss_fn_inputs={"target_tokens": [10, 11, 2]},
    )
    try:
        _wait(ready, (tmp_path / "up.log").read_text(), timeout=180)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=90)
        assert [m.id for m in client.models.list()] == [NAME]  # no demo runs were started
        assert len(client.completions.create(model=NAME, prompt="ab", max_tokens=3).choices) == 1
        rest = tinker.RestClient(base_url=url, api_key="tml-plexrl")
        assert [m.model_name for m in rest.get_server_capabilities().result().supported_models] == [
            NAME
        ]

        # two slots, six training clients (Tinker's default rank 32), one block after another
        for _ in range(3):
            with tinker.ServiceClient(base_url=url, api_key="tml-plexrl") as service:
                clients = [service.create_lora_training_client(NAME).result() for _ in range(2)]
                for c in clients:
                    c.forward_backward([datum], "cross_entropy").result(timeout=60)
                info = clients[0].get_info()
                assert (info.lora_rank, info.model_data.tokenizer_id) == (32, NAME)
                base = service.create_sampling_client(base_model=NAME).result()
                prompt = types.ModelInput.from_ints([tok.bos_token_id, 10, 11])
                assert base.sample(prompt, 1, types.SamplingParams(max_tokens=3)).result().sequences
                assert len(active()) == 2  # the base sampler holds no slot
            _wait(lambda: not active(), "a finished session's runs were not evicted")

        # a client that gives up waiting leaves the queue: it never takes a slot later
        holder = tinker.ServiceClient(base_url=url, api_key="tml-plexrl")
        for _ in range(2):
            holder.create_lora_training_client(NAME, rank=4).result()
        made = httpx.post(
            f"{url}/api/v1/create_model",
            json={"session_id": "queued", "base_model": NAME, "lora_config": {"rank": 4}},
        ).json()
        outcome = httpx.post(
            f"{url}/api/v1/retrieve_future", json={"request_id": made["request_id"]}, timeout=60
        ).json()
        assert "left the queue" in outcome.get("error", ""), (outcome, active())
        holder.close("success").result()
        _wait(lambda: not active(), "the holder's runs were not evicted")
        time.sleep(2)
        assert made["model_id"] not in active()

        # a session nobody hears from ends after session_ttl_s; one whose SDK beats lives on
        silent = httpx.post(f"{url}/api/v1/create_session", json={}).json()["session_id"]
        orphan = httpx.post(
            f"{url}/api/v1/create_model",
            json={"session_id": silent, "base_model": NAME, "lora_config": {"rank": 4}},
        ).json()
        httpx.post(
            f"{url}/api/v1/retrieve_future", json={"request_id": orphan["request_id"]}, timeout=60
        )
        alive = tinker.ServiceClient(base_url=url, api_key="tml-plexrl")
        kept = alive.create_lora_training_client(NAME, rank=4).result()
        assert active() == {orphan["model_id"], kept.model_id}
        # the orphan goes after 15-19 s; the client that beats (every 10 s) outlives it
        _wait(lambda: active() == {kept.model_id}, "a silent session did not expire", 40)
        beat = httpx.post(f"{url}/api/v1/session_heartbeat", json={"session_id": silent})
        assert beat.status_code == 410  # a finished session: the SDK stops beating
        alive.close("success").result()

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, (tmp_path / "up.log").read_text()
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
    out = (tmp_path / "up.log").read_text()
    assert f"gateway: {url}" in out
    assert not list((tmp_path / "out").glob("run_*/metrics.jsonl"))
