"""Reading the run table: one record (any service), or whole (the registry rebuilds its index
pool from this read).

nats-py ends a key watch's initial values with a ``None`` marker that it may put in the queue
before entries already on their way (it decides from a consumer-info reply that can overtake
them). A registry that trusted the marker could restart on a partial table and give an index
out twice, so ``RunTable.load`` reads until the entry the server says has nothing after it.
"""

from __future__ import annotations

from typing import Any

import pytest
from nats.js.kv import KeyValue

from schemas.codec import DecodeError, encode
from schemas.records import RunRecord
from schemas.subjects import KV_REGISTRY
from services.bus import Bus
from services.registry.table import RunTable
from services.runs import read_record, read_table


async def _bucket(bus: Bus, uid: str) -> KeyValue:
    return await bus.js.create_key_value(bucket=f"table-{uid}")


async def _fill(kv: KeyValue, n: int) -> None:
    for i in range(n):
        await kv.put(f"run_{i:03d}", encode(RunRecord(run_id=f"run_{i:03d}", status="waiting")))


async def test_an_empty_table_reads_as_empty(bus: Bus, uid: str) -> None:
    assert await read_table(await _bucket(bus, uid)) == {}


async def test_more_records_than_the_watch_queue_holds_all_come_back(bus: Bus, uid: str) -> None:
    kv = await _bucket(bus, uid)
    await _fill(kv, 300)  # nats-py's watcher queue holds 256
    await kv.delete("run_007")
    await kv.put("run_010", encode(RunRecord(run_id="run_010", status="active", idx=3)))
    table = RunTable(kv)
    records = await table.load()
    assert len(records) == 299
    assert "run_007" not in records
    assert (records["run_010"].status, records["run_010"].idx) == ("active", 3)
    assert records["run_299"].status == "waiting"
    # the revisions it remembers are the ones the next write must name
    await table.save(records["run_010"].next("evicted", released_idx=3))
    assert (await read_table(kv))["run_010"].status == "evicted"


async def test_a_table_of_only_deleted_keys_reads_as_empty(bus: Bus, uid: str) -> None:
    kv = await _bucket(bus, uid)
    await _fill(kv, 2)
    await kv.delete("run_000")
    await kv.purge("run_001")
    assert await read_table(kv) == {}


async def test_an_early_end_of_values_marker_does_not_cut_the_read_short(
    bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kv = await _bucket(bus, uid)
    await _fill(kv, 5)
    watch = KeyValue.watch

    async def watch_marking_early(self: KeyValue, *args: Any, **kwargs: Any) -> Any:
        watcher = await watch(self, *args, **kwargs)
        # what nats-py queues when the consumer-info reply overtakes the entries: the marker
        # ahead of every entry
        watcher._updates._queue.appendleft(None)
        return watcher

    monkeypatch.setattr(KeyValue, "watch", watch_marking_early)
    records = await read_table(kv)
    assert sorted(records) == [f"run_{i:03d}" for i in range(5)]


async def test_read_record_is_typed_and_none_for_a_missing_or_deleted_key(bus: Bus) -> None:
    kv = await bus.js.key_value(KV_REGISTRY)
    assert await read_record(bus, "run_nobody_here") is None
    record = RunRecord(run_id="run_rr1", status="evicted", released_idx=2, reason="diverged")
    await kv.put("run_rr1", encode(record))
    assert await read_record(bus, "run_rr1") == record
    await kv.put("run_rr1", b'{"run_id": "run_rr1", "status": "paused"}')
    with pytest.raises(DecodeError, match="status"):
        await read_record(bus, "run_rr1")
    await kv.delete("run_rr1")
    assert await read_record(bus, "run_rr1") is None
