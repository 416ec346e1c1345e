"""The gateway under load, beside an RL run training: one ``plexrl up --gateway --runs 1`` (every
service a real process) with small bounds, shared by the tests of this module.

- a burst far above the gateway's bound gets 429s (with Retry-After, OpenAI's error shape)
  before any admitted request is answered, and the admitted ones finish;
- a request whose HTTP client has left is dropped by inference, as its counter says;
- under a sampling flood the run keeps to the configured share of its pace: it completes at
  least ``1 - http_share`` as many steps in the flood as in as long a time before it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from gateway_support import REPO

from services.model.tiny import build_tiny_model

pytestmark = pytest.mark.timeout(600)
NAME = "tiny-base"
HTTP_SHARE = 0.25
MAX_INFLIGHT = 4
CALM_STEPS = 8


@dataclass
class Up:
    url: str
    metrics: str
    out: Path
    log: Path

    def steps(self) -> int:
        """Steps the run has published (its metrics.jsonl lines)."""
        return sum(
            1
            for path in self.out.glob("run_*/metrics.jsonl")
            for line in path.read_text().splitlines()
            if line.strip()
        )


def _free_block(size: int) -> int:
    """A port P with P..P+size-1 free (plexrl up gives its children P+1..P+3)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + size > 65535:
            continue
        try:
            for port in range(base + 1, base + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no block of free ports")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    root = tmp_path_factory.mktemp("load")
    model = build_tiny_model(root / "model", seed=0)
    port, metrics = _free_block(1), _free_block(4)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    env |= {
        "PLEXRL_METRICS_PORT": str(metrics),
        "PLEXRL_MAX_INFLIGHT_REQUESTS": str(MAX_INFLIGHT),
        "PLEXRL_MAX_NUM_SEQS": "32",  # 8 rows of HTTP sampling at most
        "PLEXRL_HTTP_SHARE": str(HTTP_SHARE),
        "PLEXRL_THREADS": "1",
    }
    log = root / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "services", "up", "--gateway", "--runs", "1"),
                *("--steps", "100000", "--gateway-port", str(port), "--no-live"),
                *("--model", str(model), "--output-dir", str(root / "out"), "--model-name", NAME),
            ],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    u = Up(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics + 2}/metrics", root / "out", log)
    try:
        deadline = time.monotonic() + 300
        while u.steps() < 2:  # serving, and the run trains
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        yield u
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _completion(n: int, max_tokens: int) -> dict[str, object]:
    return {"model": NAME, "prompt": "abc", "n": n, "max_tokens": max_tokens, "seed": 1}


def test_a_burst_far_above_the_bound_gets_429s_at_once_while_the_admitted_finish(up: Up) -> None:
    finished: list[int] = []  # statuses, in the order the answers came

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=up.url, timeout=300, limits=limits) as client:

            async def one() -> httpx.Response:
                response = await client.post("/v1/completions", json=_completion(16, 48))
                finished.append(response.status_code)
                return response

            return await asyncio.gather(*(one() for _ in range(10 * MAX_INFLIGHT)))

    responses = asyncio.run(burst())
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(served) + len(refused) == len(responses), {r.status_code for r in responses}
    assert MAX_INFLIGHT <= len(served) < len(responses) // 2
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", "overloaded")
        assert "max_inflight_requests = 4" in error["message"]
    # every refusal came before the first admitted request was answered: nothing queued
    first_served = finished.index(200)
    assert finished[first_served:].count(429) == 0
    for r in served:
        assert len(r.json()["choices"]) == 16


def _dropped(up: Up, reason: str) -> float:
    text = httpx.get(up.metrics, timeout=10).text
    pattern = rf'^plexrl_generate_dropped_total\{{[^}}]*reason="{reason}"[^}}]*\}} (\S+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.MULTILINE))


def test_a_request_whose_client_left_is_dropped_by_inference(up: Up) -> None:
    before = _dropped(up, "cancelled")
    # 64 sequences through 8 rows of HTTP sampling: long enough to still be generating
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{up.url}/v1/completions", json=_completion(64, 48), timeout=1.0)
    deadline = time.monotonic() + 60
    while _dropped(up, "cancelled") <= before:
        assert time.monotonic() < deadline, "inference never dropped the request"
        time.sleep(0.2)
    assert "Traceback" not in (up.out / "logs" / "gateway.log").read_text()
    # the gateway serves on, and the bound was given back
    ok = httpx.post(f"{up.url}/v1/completions", json=_completion(1, 2), timeout=120)
    assert ok.status_code == 200


def test_the_run_keeps_to_its_share_of_pace_under_a_sampling_flood(up: Up) -> None:
    start = up.steps()
    began = time.monotonic()
    while up.steps() < start + CALM_STEPS:  # the pace before, however long its steps take
        time.sleep(0.1)
    calm = time.monotonic() - began
    served: list[int] = []

    async def flood() -> int:
        stop_at = time.monotonic() + calm
        async with httpx.AsyncClient(base_url=up.url, timeout=300) as client:

            async def one_client() -> None:
                while time.monotonic() < stop_at:
                    r = await client.post("/v1/completions", json=_completion(8, 32))
                    if r.status_code == 429:  # a well-behaved client waits as it is told
                        await asyncio.sleep(float(r.headers["retry-after"]))
                    served.append(r.status_code)

            before = up.steps()
            await asyncio.gather(*(one_client() for _ in range(16)))
            return up.steps() - before

    during = asyncio.run(flood())
    assert served.count(200) >= MAX_INFLIGHT  # the flood was served, not only refused
    # in as long a time as CALM_STEPS took before: at least (1 - share) of them, less the one
    # step that may straddle either end
    assert during >= int((1 - HTTP_SHARE) * CALM_STEPS) - 1, (during, served.count(200), calm)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/v1/asample", {"detail": "busy"}),
        ("/v1/completions", {"error": {"message": "busy", "type": "rate_limit_exceeded",
                                       "param": None, "code": "overloaded"}}),
    ],
)  # fmt: skip
def test_a_429_carries_retry_after_in_each_apis_own_error_shape(
    path: str, body: dict[str, object]
) -> None:
    from starlette.requests import Request

    from services.gateway.app import error_response
    from services.gateway.errors import GatewayError

    request = Request({"type": "http", "method": "POST", "path": path, "headers": []})
    response = error_response(request, GatewayError(429, "busy", "overloaded", retry_after=1.2))
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"  # whole seconds, rounded up
    assert json.loads(response.body) == body
