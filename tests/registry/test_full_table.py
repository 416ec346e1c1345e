"""The registry's run table in a full KV bucket: a submitted run waits for room (the registry
says which limit to raise, and the paused-operations metric counts it), and is admitted with
its index once there is room; nothing is refused or lost. Real nats-server, real registry."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from schemas import subjects as sj
from schemas.codec import encode
from schemas.config import parse_orch_config
from schemas.events import RunDiscovered, RunSubmitted
from schemas.records import RunRecord
from services.bus import Bus, limits, provision

from .conftest import RegistryFactory
from .helpers import VALID_TOML, events_on, eventually, table

if TYPE_CHECKING:
    from tests.conftest import PauseCounts


async def test_a_full_run_table_pauses_admission_until_there_is_room(
    make_registry: RegistryFactory,
    rbus: Bus,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    pause_metrics: PauseCounts,
) -> None:
    monkeypatch.setattr(limits, "FIRST_DELAY", 0.05)
    monkeypatch.setattr(limits, "MAX_DELAY", 0.1)
    monkeypatch.setenv("PLEXRL_KV_MAX_BYTES", "4KiB")
    caplog.set_level(logging.WARNING, logger="services.bus.limits")
    await provision(rbus.js)
    registry = await make_registry()
    kv = await rbus.js.key_value(sj.KV_REGISTRY)
    filled = 0
    while True:  # records of runs long gone, until the bucket refuses one
        record = RunRecord(run_id=f"run_gone_{filled}", status="forgotten", reason="x" * 200)
        try:
            await kv.put(record.run_id, encode(record))
        except Exception as exc:
            assert "maximum bytes exceeded" in str(exc), exc
            break
        filled += 1
    assert filled > 0

    config = parse_orch_config(VALID_TOML)
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_waits", config=config.to_dict()))

    def paused() -> bool:
        return "KV bucket plexrl-registry is full" in caplog.text

    await eventually(lambda: asyncio.sleep(0, paused()))
    assert "Raise PLEXRL_KV_MAX_BYTES" in caplog.text
    assert "registry: run_waits" in caplog.text
    waiting = {("store_full", f"KV bucket {sj.KV_REGISTRY}"): 1}
    assert pause_metrics("plexrl_paused_operations") == waiting
    await asyncio.sleep(1.0)  # still paused: nothing admitted, nothing refused
    assert await events_on(rbus, sj.DISCOVERED, RunDiscovered) == []
    assert "run_waits" not in await table(rbus)

    monkeypatch.setenv("PLEXRL_KV_MAX_BYTES", "1MiB")
    await provision(rbus.js)

    async def admitted() -> list[RunDiscovered]:
        return await events_on(rbus, sj.DISCOVERED, RunDiscovered)

    [event] = await eventually(admitted)
    assert (event.run_id, event.idx) == ("run_waits", 0)
    assert registry.idx_of("run_waits") == 0
    record = (await table(rbus))["run_waits"]
    assert (record.status, record.idx) == ("active", 0)
    assert "resumed after" in caplog.text
    assert pause_metrics("plexrl_paused_operations") == {
        ("store_full", f"KV bucket {sj.KV_REGISTRY}"): 0
    }
    assert pause_metrics("plexrl_pauses") == {("store_full", f"KV bucket {sj.KV_REGISTRY}"): 1}
