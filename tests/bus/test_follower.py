"""The ordered follower against a real nats-server: replay, typed decode, starts, restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from schemas import RunEvicted, RunForgotten
from schemas.codec import DecodeError
from services.bus import Bus, EmbeddedNats, Follower, MessageMeta
from services.bus.follower import Start

Event = RunEvicted | RunForgotten


class Recorder:
    """A follower's callback that keeps everything it was handed."""

    def __init__(self) -> None:
        self.got: list[tuple[int, Event, MessageMeta]] = []

    def __call__(self, seq: int, event: Event, meta: MessageMeta) -> None:
        self.got.append((seq, event, meta))

    @property
    def idx(self) -> list[int]:
        return [event.idx for _, event, _ in self.got]


async def _stream(bus: Bus, uid: str) -> tuple[str, str]:
    name, prefix = f"FOLLOW_{uid}", f"follow.{uid}"
    await bus.js.add_stream(name=name, subjects=[f"{prefix}.>"])
    return name, prefix


def _evicted(i: int) -> RunEvicted:
    return RunEvicted(run_id=f"run_{i}", idx=i, reason=f"reason {i}")


async def _follow(
    bus: Bus, stream: str, subject: str, rec: Recorder, start: Start = "all", **kw: object
) -> Follower[Event]:
    follower: Follower[Event] = Follower(bus, stream, subject, Event, rec, start=start, **kw)  # type: ignore[arg-type]
    await follower.start()
    return follower


async def test_replays_then_follows_in_order_with_metadata(bus: Bus, uid: str) -> None:
    stream, prefix = await _stream(bus, uid)
    for i in range(3):
        await bus.publish(f"{prefix}.a", _evicted(i))
    await bus.publish(f"{prefix}.b", _evicted(3), fmt="msgpack")  # Content-Type says msgpack
    rec = Recorder()
    follower = await _follow(bus, stream, f"{prefix}.>", rec)
    await follower.wait_until_caught_up(5.0)
    assert rec.idx == [0, 1, 2, 3] and follower.seq == 4
    assert [seq for seq, _, _ in rec.got] == [1, 2, 3, 4]
    _, event, meta = rec.got[3]
    assert (meta.seq, meta.subject, event) == (4, f"{prefix}.b", _evicted(3))
    assert meta.headers["Content-Type"] == "application/msgpack"
    assert meta.time.tzinfo is not None
    ack = await bus.publish(f"{prefix}.a", RunForgotten(run_id="run_9", idx=9))
    await follower.wait_for_seq(ack.seq, 5.0)
    assert rec.got[-1][1] == RunForgotten(run_id="run_9", idx=9) and follower.seq == 5
    await follower.stop()


async def test_invalid_messages_are_reported_and_skipped(bus: Bus, uid: str) -> None:
    stream, prefix = await _stream(bus, uid)
    await bus.js.publish(f"{prefix}.a", b'{"type": "nonsense"}')
    await bus.publish(f"{prefix}.a", _evicted(1))
    await bus.publish(f"{prefix}.a", _evicted(2))

    rec = Recorder()

    def reject_two(seq: int, event: Event, meta: MessageMeta) -> None:
        if event.idx == 2:
            raise DecodeError("idx 2 is refused by the caller")
        rec(seq, event, meta)

    before = bus.invalid_count
    follower: Follower[Event] = Follower(bus, stream, f"{prefix}.>", Event, reject_two)
    await follower.start()
    await follower.wait_until_caught_up(5.0)
    assert rec.idx == [1] and follower.seq == 3
    assert bus.invalid_count == before + 2
    await follower.stop()


async def test_decode_subjects_only_advance_the_sequence_elsewhere(bus: Bus, uid: str) -> None:
    stream, prefix = await _stream(bus, uid)
    await bus.publish(f"{prefix}.a", _evicted(1))
    await bus.js.publish(f"{prefix}.other", b"not an event at all")
    before = bus.invalid_count
    rec = Recorder()
    follower = await _follow(
        bus, stream, f"{prefix}.>", rec, decode_subjects=frozenset({f"{prefix}.a"})
    )
    await follower.wait_until_caught_up(5.0)
    assert rec.idx == [1] and follower.seq == 2 and bus.invalid_count == before
    await follower.stop()


async def test_start_positions(bus: Bus, uid: str) -> None:
    stream, prefix = await _stream(bus, uid)
    for i, sub in enumerate("abab"):
        await bus.publish(f"{prefix}.{sub}", _evicted(i))
    by_seq, last = Recorder(), Recorder()
    f1 = await _follow(bus, stream, f"{prefix}.>", by_seq, start=3)
    f2 = await _follow(bus, stream, f"{prefix}.>", last, start="last_per_subject")
    await f1.wait_until_caught_up(5.0)
    await f2.wait_until_caught_up(5.0)
    assert by_seq.idx == [2, 3] and last.idx == [2, 3]
    # A single subject: caught up against that subject's last message, not the stream's.
    only_a = Recorder()
    f3 = await _follow(bus, stream, f"{prefix}.a", only_a)
    assert await f3.last_seq() == 3
    await f3.wait_until_caught_up(5.0)
    assert only_a.idx == [0, 2]
    for f in (f1, f2, f3):
        await f.stop()


async def test_resumes_after_stop_and_times_out_clearly(bus: Bus, uid: str) -> None:
    stream, prefix = await _stream(bus, uid)
    rec = Recorder()
    follower = await _follow(bus, stream, f"{prefix}.>", rec)
    await follower.wait_until_caught_up(5.0)  # an empty subject: nothing to wait for
    await bus.publish(f"{prefix}.a", _evicted(0))
    await follower.wait_for_seq(1, 5.0)
    await follower.stop()
    await bus.publish(f"{prefix}.a", _evicted(1))
    await follower.start()
    await follower.wait_for_seq(2, 5.0)
    assert rec.idx == [0, 1]  # not replayed from the start again
    with pytest.raises(TimeoutError, match="sequence 9 not received"):
        await follower.wait_for_seq(9, 0.2)
    assert not await follower.wait(lambda: False, 0.05)
    await follower.stop()


async def test_follows_across_a_server_restart(tmp_path: Path, uid: str) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    try:
        bus = await Bus.connect(server.url, "test")
        stream, prefix = await _stream(bus, uid)
        await bus.publish(f"{prefix}.a", _evicted(0))
        rec = Recorder()
        follower = await _follow(bus, stream, f"{prefix}.>", rec, heartbeat=0.5)
        await follower.wait_for_seq(1, 5.0)
        server.kill()
        await asyncio.sleep(0.3)
        server.start()  # same port and store: the stream survives, the consumer does not
        for i in (1, 2):
            await bus.publish(f"{prefix}.a", _evicted(i))
        await follower.wait_for_seq(3, 15.0)
        assert rec.idx == [0, 1, 2]
        await follower.stop()
        await bus.close()
    finally:
        server.close()
