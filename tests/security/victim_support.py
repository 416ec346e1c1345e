"""The victim's side of the adversarial suite: acme's run, trained by commands over its own
credentials, and a snapshot of everything about acme that an attack must leave as it was."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.errors import NoRespondersError

from schemas import subjects as sj
from schemas.events import EvictRequested, RunSubmitted
from schemas.training import (
    AdamParams,
    Datum,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    OptimStepRequest,
    OptimStepResult,
    train_subject,
)
from services.bus import Bus
from services.runs.table import list_runs

ACME = "acme"
T = TypeVar("T")

COMMANDS_RUN = {
    "env": "reverse",
    "max_steps": 1000,
    "driver": "commands",
    "model": {"lora": {"rank": 4, "alpha": 8}},
}
PROBE = [Datum(model_input=[1, 5, 6, 7, 8], loss_fn_inputs={"target_tokens": [5, 6, 7, 8, 2]})]


async def eventually(check: Callable[[], Awaitable[T]], timeout: float = 60.0) -> T:
    """``await check()`` until it returns something true; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value or time.monotonic() > deadline:
            assert value, f"still {value!r} after {timeout}s"
            return value
        await asyncio.sleep(0.1)


async def submit(bus: Bus, tenant: str, run_id: str, config: dict[str, Any] | None = None) -> Any:
    """Publish a RunSubmitted as ``tenant``; the acknowledgement (or the refusal, raised)."""
    event = RunSubmitted(run_id=run_id, config=config or COMMANDS_RUN, submitted_by="test")
    return await bus.publish(
        sj.runs_subject("submit", tenant), event, msg_id=f"{run_id}/submit/{uuid.uuid4().hex}"
    )


async def evict(bus: Bus, tenant: str, run_id: str, delete: bool = False) -> Any:
    event = EvictRequested(run_id=run_id, reason="test", requested_by="test", delete=delete)
    return await bus.publish(sj.runs_subject("evict", tenant), event)


async def rows(bus: Bus, tenant: str) -> dict[str, tuple[str, int | None]]:
    """The tenant's runs as its list service shows them: run id -> (status, step)."""
    return {r.run_id: (r.status, r.step) for r in await list_runs(bus, tenant, timeout=10.0)}


async def status_of(bus: Bus, tenant: str, run_id: str) -> str | None:
    return (await rows(bus, tenant)).get(run_id, (None, None))[0]


async def command(bus: Bus, kind: str, request: Any, result: type[T]) -> T:
    """A training command of acme's, waiting for a trainer still starting to answer."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return await bus.request(train_subject(kind, ACME), request, result, timeout=60)
        except NoRespondersError:
            assert time.monotonic() < deadline, "no trainer answers training commands"
            await asyncio.sleep(0.2)


async def train_step(bus: Bus, run_id: str, lr: float = 1e-2) -> int:
    """One forward_backward and optim_step of acme's run; the run's step after it."""
    rid = uuid.uuid4().hex
    fb = ForwardBackwardRequest(request_id=f"fb-{rid}", run_id=run_id, data=PROBE)
    got = await command(bus, "forward_backward", fb, ForwardBackwardResult)
    assert got.error is None, got.error
    step = OptimStepRequest(
        request_id=f"opt-{rid}", run_id=run_id, adam_params=AdamParams(learning_rate=lr)
    )
    done = await command(bus, "optim_step", step, OptimStepResult)
    assert done.error is None, done.error
    return done.step


async def probe_loss(bus: Bus, run_id: str) -> float:
    """The loss of acme's run on a fixed datum (forward only): it moves with any change of the
    run's adapter."""
    fb = ForwardBackwardRequest(
        request_id=f"probe-{uuid.uuid4().hex}", run_id=run_id, data=PROBE, forward_only=True
    )
    got = await command(bus, "forward_backward", fb, ForwardBackwardResult)
    assert got.error is None, got.error
    return sum(v for k, v in got.metrics.items() if k.startswith("loss"))


@dataclass(frozen=True)
class AcmeState:
    """What an attack must not change: acme's runs and steps, the loss of its trained run, the
    events in acme's own view of its runs, and the services' stored events about acme."""

    runs: dict[str, tuple[str, int | None]]
    loss: float
    view: list[tuple[int, str, bytes]]
    stored: list[tuple[int, str, bytes]]


async def stream_messages(bus: Bus, stream: str, subject: str) -> list[tuple[int, str, bytes]]:
    """Every message of ``stream`` on ``subject``: (sequence, subject, payload)."""
    out: list[tuple[int, str, bytes]] = []
    info = await bus.js.stream_info(stream)
    seq = info.state.first_seq
    while info.state.messages and seq <= info.state.last_seq:
        try:
            msg = await bus.js.get_msg(stream, seq=seq, subject=subject, next=True)
        except Exception:
            break
        if msg.seq is None or msg.seq > info.state.last_seq:
            break
        out.append((msg.seq, msg.subject or "", msg.data or b""))
        seq = msg.seq + 1
    return out


async def acme_state(acme: Bus, services: Bus, run_id: str) -> AcmeState:
    return AcmeState(
        runs=await rows(acme, ACME),
        loss=await probe_loss(acme, run_id),
        view=await stream_messages(acme, sj.RUNS_STREAM, "plexrl.runs.acme.>"),
        stored=await stream_messages(services, sj.RUNS_STREAM, "plexrl.runs.acme.>"),
    )
