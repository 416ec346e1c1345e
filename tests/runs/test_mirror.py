"""The run mirror: buffered events, hook order, replay, progress and eviction requests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from schemas import subjects as sj
from schemas.codec import decode
from schemas.config import OrchConfig
from schemas.events import EvictRequested, RunDiscovered, RunEvicted, RunForgotten, RunSubmitted
from schemas.records import Progress
from services.bus import Bus
from services.runs import RunMirror, read_progress, write_progress

CONFIG = OrchConfig(env="copy", max_steps=7)


@pytest.fixture
async def mirror(rbus: Bus) -> AsyncIterator[RunMirror]:
    m = RunMirror(rbus, max_runs=4, service="trainer")
    await m.start()
    yield m
    await m.stop()


def record_hooks(mirror: RunMirror) -> list[tuple[str, int, str]]:
    calls: list[tuple[str, int, str]] = []
    mirror.register_deletion_hook(lambda i, r: calls.append(("deletion", i, r)))
    mirror.register_creation_hook(lambda i, r: calls.append(("creation", i, r)))
    return calls


async def discovered(bus: Bus, run_id: str, idx: int, config: OrchConfig = CONFIG) -> None:
    event = RunDiscovered(
        run_id=run_id, idx=idx, config=config.to_dict(), config_digest=config.digest()
    )
    await bus.publish(sj.DISCOVERED, event)


async def test_events_are_buffered_until_synchronize_state(rbus: Bus, mirror: RunMirror) -> None:
    seen: list[tuple[int, str]] = []
    mirror.register_creation_hook(lambda i, r: seen.append((i, r)))
    await discovered(rbus, "run_a", 2)
    await rbus.publish(sj.SUBMIT, RunSubmitted(run_id="run_zz", config={}))  # not lifecycle
    await mirror.wait_until_caught_up()
    assert mirror.runs == {} and seen == []
    assert await mirror.synchronize_state() == 1  # the one lifecycle event, buffered until now
    [(idx, info)] = mirror.runs.items()
    assert (idx, info.run_id, info.idx, info.config, info.config_digest) == (
        2,
        "run_a",
        2,
        CONFIG,
        CONFIG.digest(),
    )
    assert seen == [(2, "run_a")]
    assert (mirror.idx_of("run_a"), mirror.run_id_of(2), mirror.config(2)) == (2, "run_a", CONFIG)
    assert mirror.idx_of("run_zz") is None and mirror.run_id_of(0) is None
    with pytest.raises(KeyError, match="no run holds index 0"):
        mirror.config(0)
    assert await mirror.synchronize_state() == 0


async def test_every_deletion_hook_runs_before_any_creation_hook(
    rbus: Bus, mirror: RunMirror
) -> None:
    await discovered(rbus, "run_a", 0)
    await discovered(rbus, "run_b", 1)
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    calls = record_hooks(mirror)
    await rbus.publish(sj.EVICTED, RunEvicted(run_id="run_a", idx=0, reason="diverged"))
    await discovered(rbus, "run_c", 0)
    await rbus.publish(sj.FORGOTTEN, RunForgotten(run_id="run_b", idx=1))
    await discovered(rbus, "run_d", 1)
    await mirror.wait_until_caught_up()
    assert await mirror.synchronize_state() == 4
    assert calls == [
        ("deletion", 0, "run_a"),
        ("deletion", 1, "run_b"),
        ("creation", 0, "run_c"),
        ("creation", 1, "run_d"),
    ]
    assert {i: r.run_id for i, r in mirror.runs.items()} == {0: "run_c", 1: "run_d"}


async def test_a_rediscovered_run_is_deleted_then_created(rbus: Bus, mirror: RunMirror) -> None:
    await discovered(rbus, "run_a", 0)
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    calls = record_hooks(mirror)
    # evicted and back (same id, same index, same config) within one call
    await rbus.publish(sj.EVICTED, RunEvicted(run_id="run_a", idx=0, reason="r"))
    await discovered(rbus, "run_a", 0)
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    assert [c[0] for c in calls] == ["deletion", "creation"]
    # and across two calls
    calls.clear()
    await rbus.publish(sj.FORGOTTEN, RunForgotten(run_id="run_a", idx=0))
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    await discovered(rbus, "run_a", 3)
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    assert calls == [
        ("deletion", 0, "run_a"),
        ("creation", 3, "run_a"),
    ]


async def test_unknown_indices_duplicates_and_short_lived_runs_get_no_hooks(
    rbus: Bus, mirror: RunMirror
) -> None:
    await discovered(rbus, "run_a", 0)
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    calls = record_hooks(mirror)
    await rbus.publish(sj.EVICTED, RunEvicted(run_id="run_x", idx=3, reason="not held"))
    await rbus.publish(sj.FORGOTTEN, RunForgotten(run_id="run_a", idx=1))  # wrong index
    await discovered(rbus, "run_a", 0)  # the same announcement again
    await discovered(rbus, "run_big", 9)  # beyond max_runs=4
    await discovered(rbus, "run_blip", 2)  # comes and goes within one call
    await rbus.publish(sj.EVICTED, RunEvicted(run_id="run_blip", idx=2, reason="r"))
    await mirror.wait_until_caught_up()
    assert await mirror.synchronize_state() == 6
    assert calls == []
    assert {i: r.run_id for i, r in mirror.runs.items()} == {0: "run_a"}


async def test_a_late_mirror_replays_the_stream_to_the_same_state(
    rbus: Bus, mirror: RunMirror
) -> None:
    await discovered(rbus, "run_a", 0)
    await discovered(rbus, "run_b", 1)
    await rbus.publish(sj.EVICTED, RunEvicted(run_id="run_a", idx=0, reason="r"))
    await discovered(rbus, "run_c", 0)
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    late = RunMirror(rbus, max_runs=4)
    created: list[tuple[int, str]] = []
    late.register_creation_hook(lambda i, r: created.append((i, r)))
    await late.start()
    try:
        await late.wait_until_caught_up()
        assert await late.synchronize_state() == 4
        assert late.runs == mirror.runs
        assert created == [(1, "run_b"), (0, "run_c")]
    finally:
        await late.stop()


async def test_progress_round_trip_and_eviction_requests(rbus: Bus, mirror: RunMirror) -> None:
    assert await read_progress(rbus, "run_a") is None
    await write_progress(rbus, "run_a", Progress(step=3, total_tokens=120, total_samples=24))
    await discovered(rbus, "run_a", 1)
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    progress = await read_progress(rbus, "run_a")
    assert progress is not None
    assert (progress.step, progress.total_tokens, progress.total_samples) == (3, 120, 24)
    assert progress.updated_at > 0 and progress.reward_mean is None
    raw = await (await rbus.js.key_value(sj.KV_PROGRESS)).get("run_a")
    assert raw.value is not None and raw.value.startswith(b'{"step":3,"total_tokens":120')

    await mirror.evict_run(1, "loss is NaN")
    raw_request = await rbus.js.get_last_msg(sj.RUNS_STREAM, sj.EVICT)
    request: EvictRequested = decode(raw_request.data or b"", EvictRequested)
    assert (request.run_id, request.reason, request.requested_by) == (
        "run_a",
        "loss is NaN",
        "trainer",
    )
    with pytest.raises(KeyError, match="no run holds it"):
        await mirror.evict_run(0, "nobody there")


async def test_an_undecodable_lifecycle_event_is_reported_and_skipped(
    rbus: Bus, mirror: RunMirror
) -> None:
    before = rbus.invalid_count
    await rbus.js.publish(sj.DISCOVERED, b'{"type": "run_discovered", "run_id": "nope"}')
    await discovered(rbus, "run_a", 1)
    await mirror.wait_until_caught_up()
    assert await mirror.synchronize_state() == 1
    assert mirror.idx_of("run_a") == 1 and rbus.invalid_count == before + 1


async def test_a_follower_rank_applies_up_to_the_broadcast_sequence(rbus: Bus) -> None:
    """A non-main rank applies exactly up to the main rank's sequence, waiting for it if behind."""
    targets: list[int] = []
    follower = RunMirror(rbus, max_runs=4, broadcast=lambda seq: targets.pop(0))
    calls = record_hooks(follower)
    await discovered(rbus, "run_a", 0)
    await discovered(rbus, "run_b", 1)
    await follower.start()
    try:
        targets.append(1)  # the main rank had seen only the first event
        await follower.wait_until_caught_up()
        assert await follower.synchronize_state() == 1
        assert calls == [("creation", 0, "run_a")]
        targets.append(3)  # ahead of this rank: it waits for sequence 3
        pending = asyncio.ensure_future(follower.synchronize_state())
        await asyncio.sleep(0.05)
        assert not pending.done()
        await rbus.publish(sj.EVICTED, RunEvicted(run_id="run_a", idx=0, reason="r"))
        assert await asyncio.wait_for(pending, 5.0) == 2
        assert calls[1:] == [("deletion", 0, "run_a"), ("creation", 1, "run_b")]
    finally:
        await follower.stop()
