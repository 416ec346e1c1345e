"""Helpers of the gateway tests: a whole plexrl on loopback, started as processes."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
UNEMBED_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Stack:
    nats_url: str
    model: Path
    out: Path
    logs: Path
    url: str
    otlp: str = ""
    """the OTLP/HTTP endpoint every process exports its spans to ("" for none)"""
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def all_logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-4000:]}" for n in self.procs)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        env = os.environ | {"PLEXRL_NATS_URL": self.nats_url, "PLEXRL_CONNECT_WAIT_S": "30"}
        env.pop("OTEL_SERVICE_NAME", None)
        if self.otlp:
            env |= {
                "OTEL_TRACES_EXPORTER": "otlp",
                "OTEL_EXPORTER_OTLP_ENDPOINT": self.otlp,
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            }
        log = (self.logs / f"{name}.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services", *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.procs[name] = proc
        return proc

    def stop(self, name: str) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def start_gateway(self, port: int, *extra: str) -> None:
        self.start(
            "gateway",
            *("gateway", "--model", str(self.model), "--port", str(port)),
            *("--model-alias", "tiny-base", "--max-tokens", "64", "--max-body-bytes", "200000"),
            *("--request-timeout-s", "60", "--train-unembed", *extra),
        )

    def wait_http(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited early:\n{self.all_logs()}"
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"the gateway never answered:\n{self.all_logs()}")


def evict_runs(stack: Stack, run_ids: set[str], reason: str) -> None:
    """Evict ``run_ids`` (freeing the stack's run slots for the next tests) and wait until the
    gateway no longer lists them."""
    import asyncio

    from schemas import subjects as sj
    from schemas.events import EvictRequested
    from services.bus import Bus

    async def evict() -> None:
        bus = await Bus.connect(stack.nats_url, "test")
        try:
            for run_id in sorted(run_ids):
                request = EvictRequested(run_id=run_id, reason=reason, requested_by="test")
                await bus.publish(sj.EVICT, request, msg_id=f"{run_id}/evict/{reason}")
        finally:
            await bus.close()

    asyncio.run(evict())
    deadline = time.monotonic() + 60
    while run_ids & {m["id"] for m in httpx.get(f"{stack.url}/v1/models").json()["data"]}:
        assert time.monotonic() < deadline, f"never evicted: {run_ids}"
        time.sleep(0.2)


def otlp_receiver_module() -> Any:
    """tests/telemetry/otlp_receiver.py: an OTLP/HTTP receiver that keeps the spans sent to it."""
    path = REPO / "tests" / "telemetry" / "otlp_receiver.py"
    spec = importlib.util.spec_from_file_location("gateway_otlp_receiver", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def rl_datum(prompt: list[int], completion: Any, advantage: float) -> Any:
    """A Tinker ``importance_sampling`` datum of one sampled sequence: the completion's tokens
    scored with the sampler's log-probabilities and the sequence's advantage; the prompt's
    positions carry nothing."""
    from tinker import types

    tokens = prompt + list(completion.tokens)
    n = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * n + list(completion.logprobs),
            "advantages": [0.0] * n + [advantage] * len(completion.tokens),
        },
    )


@contextlib.contextmanager
def running_stack(
    root: Path,
    model: Path,
    *,
    otlp: str = "",
    max_runs: int = 16,
    registry_args: tuple[str, ...] = (),
) -> Iterator[Stack]:
    """nats-server, registry, trainer, inference and gateway on loopback, stopped on exit."""
    from services.bus import EmbeddedNats

    out, logs = root / "out", root / "logs"
    out.mkdir()
    logs.mkdir()
    with EmbeddedNats(store_dir=root / "nats") as server:
        port = free_port()
        s = Stack(server.url, model, out, logs, f"http://127.0.0.1:{port}", otlp)
        common = ("--output-dir", str(out), "--max-runs", str(max_runs), "--max-lora-rank", "32")
        # Tinker's train_unembed: the unembedding carries LoRA too
        targets = ("--target-modules", UNEMBED_TARGETS, "--threads", "1")
        s.start("registry", "registry", *common, *registry_args)
        s.start("trainer", "trainer", "--model", str(model), *common, *targets)
        s.start("inference", "inference", "--model", str(model), *common, *targets)
        s.start_gateway(port)
        try:
            s.wait_http()
            yield s
        finally:
            for name in list(s.procs):
                s.stop(name)
