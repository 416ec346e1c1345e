"""What a reconnect does to the work in flight, against a real nats-server SIGKILLed and started
again on its own store: a request is sent again and answered, a follower subscribes again, a
pull consumer gets back a message delivered into the dead connection. Without them each would
wait out a timeout (the request's, two heartbeats, ``ack_wait``) set here far beyond what the
test allows: the bound each test waits is the proof that nothing waited it out."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from nats.aio.msg import Msg

from schemas import RunEvicted
from schemas.codec import decode, encode
from schemas.events import GenerateRequest, GenerateResponse
from services.bus import Bus, Consumer, EmbeddedNats, Follower, MessageMeta, flushed
from services.bus.limits import purge_consumed

REQUEST_TIMEOUT = 120.0
"""the orchestrator's default generate timeout: what a lost request used to wait out"""
HEARTBEAT = 30.0
"""a follower's idle heartbeat: nats-py notices a lost ordered consumer after two of them"""
ACK_WAIT = 120.0


async def _restart(server: EmbeddedNats, bus: Bus, *, kill: bool = True) -> None:
    """SIGKILL (or stop) the server, start it again on the same store and port, wait for
    ``bus`` to reconnect."""
    before = bus.reconnects.count
    if kill:
        server.kill()
    else:
        server.stop()
    await asyncio.sleep(0.5)
    server.start()
    deadline = time.monotonic() + 30
    while bus.reconnects.count == before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert bus.reconnects.count == before + 1


async def _worker(bus: Bus, stream: str, subject: str, *, messages: int) -> Consumer[RunEvicted]:
    """A stream holding ``messages`` RunEvicted events and its durable consumer ``worker``,
    started and recovering on reconnects, as the trainer's rollouts consumer is."""
    await bus.js.add_stream(name=stream, subjects=[subject])
    consumer: Consumer[RunEvicted] = Consumer(
        bus,
        stream=stream,
        durable="worker",
        filter_subject=subject,
        event_type=RunEvicted,
        ack_wait=ACK_WAIT,
    )
    consumer.recover_on_reconnect()
    await consumer.start()
    for i in range(messages):
        await bus.publish(subject, RunEvicted(run_id=f"run_{i}", idx=i, reason="r"))
    return consumer


async def test_a_request_lost_with_the_server_is_sent_again_on_the_reconnect(
    tmp_path: Path,
) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    client = await Bus.connect(server.url, "client", provision_streams=False)
    responder = await Bus.connect(server.url, "responder", provision_streams=False)
    seen: list[str] = []
    first = asyncio.Event()

    async def answer(msg: Msg) -> None:
        request = decode(msg.data, GenerateRequest)
        seen.append(request.request_id)
        if len(seen) == 1:
            first.set()  # the first copy is never answered: its server dies meanwhile
            return
        reply = GenerateResponse(
            request_id=request.request_id, run_id=request.run_id, policy_version=7, completions=[]
        )
        await responder.nc.publish(msg.reply, encode(reply))

    await responder.nc.subscribe("test.ask", cb=answer)
    await flushed(responder.nc)
    try:
        ask = GenerateRequest(request_id="req-1", run_id="run_x", prompts=[[1, 2]])
        started = time.monotonic()
        reply = asyncio.create_task(
            client.request("test.ask", ask, GenerateResponse, timeout=REQUEST_TIMEOUT)
        )
        await asyncio.wait_for(first.wait(), 10)
        await _restart(server, client)
        answered = await asyncio.wait_for(reply, 30)
        took = time.monotonic() - started
        print(
            f"request answered {took:.1f}s after it was first sent (timeout {REQUEST_TIMEOUT:g}s)"
        )
        assert (answered.request_id, answered.policy_version) == ("req-1", 7)
        assert seen == ["req-1", "req-1"]  # the same request, sent once more after the reconnect
    finally:
        await client.close()
        await responder.close()
        server.close()


async def test_a_follower_subscribes_again_on_the_reconnect_not_after_missed_heartbeats(
    tmp_path: Path, uid: str
) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    bus = await Bus.connect(server.url, "test")
    got: list[int] = []

    def on_event(seq: int, event: RunEvicted, meta: MessageMeta) -> None:
        got.append(event.idx)

    try:
        stream, prefix = f"FOLLOW_{uid}", f"follow.{uid}"
        await bus.js.add_stream(name=stream, subjects=[f"{prefix}.>"])
        await bus.publish(f"{prefix}.a", RunEvicted(run_id="run_0", idx=0, reason="r"))
        follower: Follower[RunEvicted] = Follower(
            bus, stream, f"{prefix}.>", RunEvicted, on_event, heartbeat=HEARTBEAT
        )
        await follower.start()
        await follower.wait_for_seq(1, 5.0)
        await _restart(server, bus)  # the ordered consumer dies with the server
        ack = await bus.publish(f"{prefix}.a", RunEvicted(run_id="run_1", idx=1, reason="r"))
        # two missed heartbeats would be 60 s; the reconnect brings it well before
        await follower.wait_for_seq(ack.seq, HEARTBEAT / 2)
        assert got == [0, 1] and follower.resubscribed == 1
        await follower.stop()
    finally:
        await bus.close()
        server.close()


async def test_a_message_delivered_into_a_lost_connection_comes_back_at_once(
    tmp_path: Path, uid: str
) -> None:
    """The server hands a message to the consumer and it never arrives (here another
    connection takes it in the consumer's name and drops it): after the next reconnect the
    consumer is made anew from its ack floor and gets it again, instead of after ack_wait; a
    delivery it held from before the reconnect is stale, and settling it is a no-op."""
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    bus = await Bus.connect(server.url, "trainer")
    thief = await Bus.connect(server.url, "thief", provision_streams=False)
    stream, subject = f"LOST_{uid}", f"lost.{uid}"
    try:
        consumer = await _worker(bus, stream, subject, messages=3)
        ((_, kept),) = await consumer.fetch(batch=1, timeout=5.0)
        assert consumer.holding() == {kept.stream_sequence}
        lost = await thief.js.pull_subscribe(subject, durable="worker", stream=stream)
        (dropped,) = await lost.fetch(1, timeout=5.0)  # delivered, never to arrive
        assert dropped.metadata.sequence.stream == 2
        # stopped, not killed: the server's consumer state, written lazily, says both were
        # delivered (a SIGKILL may forget either, which the server then delivers again itself)
        await _restart(server, bus, kill=False)
        again = await consumer.fetch(batch=8, timeout=5.0)
        assert [(e.idx, d.stream_sequence) for e, d in again] == [(0, 1), (1, 2), (2, 3)]
        assert consumer.generation == 1 and kept.stale
        await kept.ack()  # stale: a no-op, the new delivery of stream sequence 1 acks it
        for _, delivery in again:
            await delivery.ack()
        info = await bus.js.consumer_info(stream, "worker")
        assert (info.num_ack_pending, info.num_pending, info.ack_floor.stream_seq) == (0, 0, 3)
        await consumer.close()
    finally:
        await bus.close()
        await thief.close()
        server.close()


async def test_an_ack_the_restarted_server_forgot_comes_back_while_its_delivery_is_still_held(
    tmp_path: Path, uid: str
) -> None:
    """The user acks a message (the server confirms) and still has the delivery in hand, as the
    trainer does while it finishes the step; the server then comes back without the ack (here
    the consumer is made again and handed the message in another connection, as a SIGKILL
    before the server wrote its state leaves it). The acked delivery is not counted as held, so
    on the reconnect the message comes again at once, not after ack_wait."""
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    bus = await Bus.connect(server.url, "trainer")
    other = await Bus.connect(server.url, "other", provision_streams=False)
    stream, subject = f"FORGOT_{uid}", f"forgot.{uid}"
    try:
        consumer = await _worker(bus, stream, subject, messages=2)
        ((_, in_hand),) = await consumer.fetch(batch=1, timeout=5.0)
        await in_hand.ack()
        assert consumer.holding() == set()
        # the server forgets the ack: the consumer's state from before it, message 1 pending
        config = (await bus.js.consumer_info(stream, "worker")).config
        await other.js.delete_consumer(stream, "worker")
        await other.js.add_consumer(stream, config=config)
        sub = await other.js.pull_subscribe(subject, durable="worker", stream=stream)
        (forgotten,) = await sub.fetch(1, timeout=5.0)
        assert forgotten.metadata.sequence.stream == 1
        await _restart(server, bus, kill=False)
        again = await consumer.fetch(batch=8, timeout=5.0)
        assert [(e.idx, d.stream_sequence) for e, d in again] == [(0, 1), (1, 2)]
        assert consumer.generation == 1 and consumer.holding() == {1, 2}
        await in_hand.ack()  # stale: a no-op that leaves the new delivery of 1 counted
        assert consumer.holding() == {1, 2}
        for _, delivery in again:
            await delivery.ack()
        info = await bus.js.consumer_info(stream, "worker")
        assert (info.num_ack_pending, info.num_pending, info.ack_floor.stream_seq) == (0, 0, 2)
        await consumer.close()
    finally:
        await bus.close()
        await other.close()
        server.close()


async def test_a_purge_in_flight_when_the_server_dies_is_abandoned_at_the_reconnect(
    tmp_path: Path, uid: str
) -> None:
    """The trainer's purge of consumed batches is best effort: one whose request went to a
    server that then died ends at the reconnect (its answer will never come), not when its
    JetStream timeout (here 120 s) runs out, and the next purge removes the same messages."""
    server = EmbeddedNats(store_dir=tmp_path / "js")
    server.start()
    bus = await Bus.connect(server.url, "trainer")
    stream, subject = f"PURGE_{uid}", f"purge.{uid}"
    js = bus.nc.jetstream(timeout=REQUEST_TIMEOUT)
    try:
        await bus.js.add_stream(name=stream, subjects=[subject])
        for i in range(3):
            await bus.publish(subject, RunEvicted(run_id=f"run_{i}", idx=i, reason="r"))
        sub = await bus.js.pull_subscribe(subject, durable="trainer", stream=stream)
        for msg in await sub.fetch(3, timeout=5.0):
            await msg.ack_sync()
        await _restart(server, bus, kill=False)  # the acks on disk, to outlive the SIGKILL
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # the request goes out, no answer comes
        purge = asyncio.create_task(
            purge_consumed(js, stream, subject, newest=3, lost=bus.reconnects.lost)
        )
        await asyncio.sleep(0.3)
        await _restart(server, bus)
        await asyncio.wait_for(purge, 10.0)  # abandoned at the reconnect
        assert (await bus.js.stream_info(stream)).state.messages == 3
        await purge_consumed(js, stream, subject, newest=3, lost=bus.reconnects.lost)
        assert (await bus.js.stream_info(stream)).state.messages == 1  # the newest stays
    finally:
        await bus.close()
        server.close()
