"""Admission from the typed run record, RunWatch's incarnations and PolicyVersions' clock,
against a real nats-server with hand-written records and events (no registry)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from schemas import subjects as sj
from schemas.codec import encode
from schemas.config import OrchConfig
from schemas.events import LoraSpec, RunDiscovered, RunEvicted, WeightsReady
from schemas.records import RunRecord
from services.bus import Bus
from services.orchestrator.lifecycle import Admission, RunRejected, RunRemoved, RunWatch, admit
from services.orchestrator.versions import PolicyVersions

from .conftest import RUN

CONFIG = OrchConfig(env="copy", max_steps=3)


async def _record(bus: Bus, record: RunRecord) -> None:
    await (await bus.js.key_value(sj.KV_REGISTRY)).put(record.run_id, encode(record))


async def _discovered(bus: Bus, idx: int) -> None:
    event = RunDiscovered(
        run_id=RUN, idx=idx, config=CONFIG.to_dict(), config_digest=CONFIG.digest()
    )
    await bus.publish(sj.DISCOVERED, event)


async def _admit(bus: Bus, watch: RunWatch) -> Admission | None:
    return await admit(bus, watch, CONFIG, submitted_by="test", stop=asyncio.Event())


async def test_admit_reads_the_typed_record(obus: Bus) -> None:
    watch = RunWatch(obus, RUN)
    await watch.start()
    try:
        await _record(obus, RunRecord(run_id=RUN, status="evicted", reason="diverged"))
        with pytest.raises(RunRemoved, match="diverged"):
            await _admit(obus, watch)
        held = RunRecord(run_id=RUN, status="active", idx=0, config_digest="sha256:" + "0" * 64)
        await _record(obus, held)
        with pytest.raises(RunRejected, match="different config"):
            await _admit(obus, watch)
    finally:
        await watch.stop()


async def test_watch_tells_incarnations_apart_and_versions_ignore_older_ones(obus: Bus) -> None:
    await _discovered(obus, 0)
    await obus.publish(sj.weights_subject(RUN), _ready(5))
    await obus.publish(sj.EVICTED, RunEvicted(run_id=RUN, idx=0, reason="r"))
    await _discovered(obus, 1)
    watch = RunWatch(obus, RUN)
    await watch.start()
    try:
        start = watch.incarnation_start()
        assert start is not None and start.seq == 3 and start.time.tzinfo is not None
        assert [type(e.event).__name__ for e in watch.entries] == [
            "RunDiscovered",
            "RunEvicted",
            "RunDiscovered",
        ]
        assert watch.removal_after(1) is not None and watch.removal_after(2) is None
        await _record(obus, RunRecord(run_id=RUN, status="active", idx=1))
        admission = await _admit(obus, watch)
        assert admission is not None and (admission.idx, admission.incarnation_seq) == (1, 3)
        versions = PolicyVersions(obus, RUN, since=start.time)
        await versions.start()
        assert versions.latest == 0  # step 5 belongs to the earlier incarnation
        waiting = asyncio.ensure_future(versions.wait_for(2))
        await obus.publish(sj.weights_subject(RUN), _ready(2))
        assert await asyncio.wait_for(waiting, 5.0) == 2
        await versions.stop()
        old = PolicyVersions(obus, RUN, since=datetime(2000, 1, 1, tzinfo=UTC))
        await old.start()
        assert old.latest == 5
        await old.stop()
    finally:
        await watch.stop()


def _ready(step: int) -> WeightsReady:
    return WeightsReady(
        run_id=RUN,
        idx=0,
        step=step,
        transport="object_store",
        location=f"{RUN}/step_{step}",
        digest="sha256:" + "a" * 64,
        size_bytes=1,
        lora=LoraSpec(rank=4, alpha=8.0, target_modules=["q_proj"]),
    )
