"""Fuzzing the registry's decoders: submit and evict (JetStream, every subject form) and the run
list (request/reply). Every bad payload is terminated or answered with an error and reported as
InvalidMessage; every payload is settled; the runs submitted and evicted around them are
processed; the registry keeps serving."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import subjects as sj
from schemas.codec import decode
from schemas.events import EvictRequested, RunConfigInvalid, RunList, RunListRequest, RunSubmitted
from services.bus import Bus
from services.bus.last import last_message
from services.registry.listing import BAD_REQUEST
from services.registry.service import Registry

from .fuzz_payloads import Wire, decodes, fuzz, tenant_ok, tokens, wires
from .fuzz_support import Reports, eventually, publish, reply_of, request, settled

CONFIG: dict[str, Any] = {"env": "reverse", "max_steps": 5, "model": {"lora": {"rank": 2}}}

SUBMIT = RunSubmitted(run_id="run_fz", config=CONFIG, submitted_by="fuzz")
EVICT = EvictRequested(run_id="run_fz_gone", reason="fuzz", requested_by="fuzz")


def _one_token(pattern: str, fixed: list[str]) -> st.SearchStrategy[str]:
    return st.sampled_from(fixed) | tokens.map(pattern.format)


def _bad_request(wire: Wire) -> bool:
    """A submit or evict the registry must terminate and report: no such event, or a subject
    with no usable tenant."""
    event_type = RunSubmitted if wire.subject.endswith(".submit") else EvictRequested
    return decodes(wire, event_type) is None or not tenant_ok(wire.subject)


requests = st.one_of(
    wires(_one_token("plexrl.runs.{}.submit", [sj.SUBMIT, "plexrl.runs.acme.submit"]), SUBMIT),
    wires(_one_token("plexrl.runs.{}.evict", [sj.EVICT, "plexrl.runs.acme.evict"]), EVICT),
)

fence_numbers = itertools.count(1)


@pytest.fixture
async def registry(make_registry: Any, fbus: Bus) -> AsyncIterator[Registry]:
    r: Registry = await make_registry(max_runs=2)
    await fbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_fence0", config=CONFIG))
    await eventually(lambda: _has(r, "run_fence0"), "the first run submitted")
    yield r


@pytest.fixture
async def reports(fbus: Bus) -> AsyncIterator[Reports]:
    r = await Reports(fbus, "registry").start()
    yield r
    await r.stop()


async def _has(registry: Registry, run_id: str, status: str | None = None) -> bool:
    record = registry.records.get(run_id)
    return record is not None and (status is None or record.status == status)


async def _refused_for_acme(bus: Bus, run_id: str) -> bool:
    stored = await last_message(bus, sj.RUNS_STREAM, "plexrl.runs.acme.invalid")
    return stored is not None and decode(stored.data, RunConfigInvalid).run_id == run_id


@fuzz(20)
@given(batch=st.lists(requests, min_size=1, max_size=5))
async def test_bad_submits_and_evictions_are_terminated_and_reported(
    registry: Registry, fbus: Bus, reports: Reports, batch: list[Wire]
) -> None:
    n = next(fence_numbers)
    since = reports.mark()
    for wire in batch:
        await publish(fbus, wire)
    # Good messages behind the bad ones, on every consumer.
    fence = f"run_fence{n}"
    await fbus.publish(sj.SUBMIT, RunSubmitted(run_id=fence, config=CONFIG))
    await fbus.publish(sj.runs_subject("submit", "acme"), RunSubmitted(run_id=fence, config=CONFIG))
    previous = f"run_fence{n - 1}"
    await fbus.publish(sj.EVICT, EvictRequested(run_id=previous, reason="fuzz fence"))
    await fbus.publish(sj.runs_subject("evict", "acme"), EvictRequested(run_id=fence, reason="x"))

    await eventually(lambda: _has(registry, fence), f"{fence} submitted after the payloads")
    await eventually(lambda: _has(registry, previous, "evicted"), f"{previous} evicted")
    await eventually(lambda: _refused_for_acme(fbus, fence), "the tenant's submit answered")
    for consumer in registry._consumers:
        await eventually(
            partial(settled, consumer), f"every message on {consumer.filter_subject} settled"
        )
    await reports.expect(since, [w for w in batch if _bad_request(w)])


def _bad_list_request(wire: Wire) -> bool:
    if not tenant_ok(wire.subject):
        return True
    return bool(wire.data.strip()) and decodes(wire, RunListRequest) is None


list_requests = wires(
    _one_token("plexrl.registry.{}.list", [sj.REGISTRY_LIST, "plexrl.registry.acme.list"]),
    RunListRequest(statuses=["active"]),
)


@fuzz(20)
@given(batch=st.lists(st.tuples(list_requests, st.booleans()), min_size=1, max_size=5))
async def test_bad_run_list_requests_are_answered_with_an_error_and_reported(
    registry: Registry, fbus: Bus, reports: Reports, batch: list[tuple[Wire, bool]]
) -> None:
    since = reports.mark()
    bad = []
    for wire, with_reply in batch:
        if not with_reply:  # nothing to answer: it can only be reported
            await fbus.nc.publish(wire.subject, wire.data, headers=wire.headers)
            bad.append(wire)
            continue
        answer: RunList = reply_of(await request(fbus, wire), RunList)
        if _bad_list_request(wire):
            bad.append(wire)
            assert answer.error is not None and answer.error.startswith(BAD_REQUEST), answer
            assert answer.runs == []
        else:
            assert answer.error is None, (wire, answer)
    good = await fbus.request(sj.REGISTRY_LIST, RunListRequest(), RunList, timeout=10.0)
    assert good.error is None and "run_fence0" in {row.run_id for row in good.runs}
    await reports.expect(since, bad)
