"""Fuzzing an inference replica's decoders: generate requests (request/reply, every tenant's
subject), the WeightsReady announcements it follows and the lifecycle events of its run mirror.

Every bad request is answered with an error, every bad announcement or lifecycle event skipped,
and each is reported as InvalidMessage on ``plexrl.errors.inference``; the requests, runs and
announcements sent around them are served, applied and held; the replica keeps serving."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import subjects as sj
from schemas.events import (
    GenerateRequest,
    GenerateResponse,
    LoraSpec,
    RunDiscovered,
    RunEvicted,
    WeightsReady,
)
from services.bus import Bus, EmbeddedNats
from services.inference.requests import RequestFailed, check_progress, check_request
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine

from .fuzz_payloads import Thrown, Wire, decodes, fuzz, lifecycle_rejects, tenant_ok, tokens, wires
from .fuzz_support import Reports, eventually, publish, reply_of, request

LIVE, NOBODY, CYCLING = "run_live", "run_nobody", "run_cyc"
LORA = {"model": {"lora": {"rank": 2, "alpha": 4.0}}}


def _weights(run_id: str, step: int = 1) -> WeightsReady:
    return WeightsReady(
        run_id=run_id,
        idx=1,
        step=step,
        transport="object_store",
        location=f"{run_id}/step_{step}",
        digest="sha256:" + "0" * 64,
        size_bytes=10,
        lora=LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"]),
    )


GENERATE = GenerateRequest(request_id="fz", run_id=NOBODY, prompts=[[5, 6]], max_tokens=2)
REQUESTS = wires(
    st.sampled_from([sj.GENERATE, sj.generate_subject("acme")])
    | tokens.map("plexrl.inference.{}.generate".format),
    GENERATE,
)
ANNOUNCEMENTS = wires(
    st.sampled_from([sj.weights_subject(NOBODY), sj.tenant_weights_subject(NOBODY, "acme")])
    | st.lists(tokens, min_size=1, max_size=2).map(lambda t: "plexrl.weights." + ".".join(t)),
    _weights(NOBODY),
)
LIFECYCLE = lifecycle_rejects(NOBODY, LORA)


THROWN = st.one_of(
    st.builds(Thrown, st.just("generate"), REQUESTS, st.booleans()),
    st.builds(Thrown, st.just("weights"), ANNOUNCEMENTS),
    st.builds(Thrown, st.just("lifecycle"), LIFECYCLE),
)


def _bad_request(wire: Wire, engine: TorchEngine) -> bool:
    """A request the replica must answer with an error and report: on a subject with no usable
    tenant, no GenerateRequest, one this model cannot serve, or one naming a progress subject
    outside its tenant's inboxes."""
    req = decodes(wire, GenerateRequest)
    if req is None or not tenant_ok(wire.subject):
        return True
    try:
        check_request(req, engine.vocab_size, engine.max_model_len)
        check_progress(req, sj.tenant_of_subject(wire.subject))
    except RequestFailed:
        return True
    return False


def _bad_announcement(wire: Wire) -> bool:
    event = decodes(wire, WeightsReady)
    if event is None:
        return True
    try:
        _, run_id = sj.per_run_subject(wire.subject)
    except ValueError:
        return True
    return run_id != event.run_id


def _is_bad(thrown: Thrown, engine: TorchEngine) -> bool:
    match thrown.target:
        case "generate":
            return not thrown.with_reply or _bad_request(thrown.wire, engine)
        case "weights":
            return _bad_announcement(thrown.wire)
    return True


# --- the replica ----------------------------------------------------------------------------


@dataclass
class Replica:
    service: InferenceService
    engine: TorchEngine
    bus: Bus
    reports: Reports
    rounds: itertools.count[int]


@pytest.fixture
async def replica(
    server: EmbeddedNats, fbus: Bus, tmp_path: Path, fuzz_model: Path
) -> AsyncIterator[Replica]:
    bus = await Bus.connect(server.url, "inference")
    engine = TorchEngine(fuzz_model, max_runs=2, max_lora_rank=4, batch_window_ms=1.0)
    service = InferenceService(
        bus, engine, max_runs=2, replica_name="fuzz", output_dir=tmp_path, shutdown_grace=2.0
    )
    await service.start()
    reports = await Reports(fbus, "inference").start()
    await fbus.publish(sj.DISCOVERED, RunDiscovered(run_id=LIVE, idx=0, config=LORA))
    await eventually(lambda: _known(service, LIVE), f"{LIVE} known to the replica")
    yield Replica(service, engine, fbus, reports, itertools.count())
    await reports.stop()
    await service.stop()
    await bus.close()


async def _known(service: InferenceService, run_id: str) -> bool:
    return service.mirror.idx_of(run_id) is not None


async def _held(service: InferenceService, run_id: str) -> bool:
    return run_id in service._held


async def _throw(r: Replica, thrown: Thrown) -> None:
    wire = thrown.wire
    if thrown.target != "generate":
        await publish(r.bus, wire)
    elif not thrown.with_reply:
        await r.bus.nc.publish(wire.subject, wire.data, headers=wire.headers)
    else:
        answer: GenerateResponse = reply_of(await request(r.bus, wire, 5.0), GenerateResponse)
        assert answer.error is not None and answer.completions == [], (wire, answer)
        if _bad_request(wire, r.engine):
            assert answer.error.startswith("invalid GenerateRequest"), (wire, answer)
        else:  # a request for a run this replica does not serve
            assert "unknown run" in answer.error, (wire, answer)


def _answered(answer: Any) -> bool:
    return answer.error is None and len(answer.completions) == 1


@fuzz(20)
@given(batch=st.lists(THROWN, min_size=1, max_size=6))
async def test_bad_requests_announcements_and_lifecycle_events_are_rejected_and_reported(
    replica: Replica, batch: list[Thrown]
) -> None:
    r, bus = replica, replica.bus
    since = r.reports.mark()
    for thrown in batch:
        await _throw(r, thrown)
    # Good messages behind the bad ones, on every path.
    n = next(r.rounds)
    if n:
        await bus.publish(sj.EVICTED, RunEvicted(run_id=f"{CYCLING}{n - 1}", idx=1, reason="x"))
    await bus.publish(sj.DISCOVERED, RunDiscovered(run_id=f"{CYCLING}{n}", idx=1, config=LORA))
    held = f"run_held{n}"
    await bus.publish(sj.weights_subject(held), _weights(held))
    good = GenerateRequest(request_id=f"good{n}", run_id=LIVE, prompts=[[5, 6]], max_tokens=2)
    assert _answered(await bus.request(sj.GENERATE, good, GenerateResponse, timeout=10.0))

    await eventually(lambda: _known(r.service, f"{CYCLING}{n}"), f"{CYCLING}{n} known")
    await eventually(lambda: _held(r.service, held), f"the weights of {held} held")
    await r.reports.expect(since, [t.wire for t in batch if _is_bad(t, r.engine)])
