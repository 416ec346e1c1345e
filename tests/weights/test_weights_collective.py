"""The ``collective`` transport: gloo broadcasts from a CollectiveSender to receivers on a real
nats-server, in this process (receiver threads) and in child processes (this file run as a
script: ``python test_weights_collective.py child ...``)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from schemas.events import LoraSpec, WeightsReady
from services.bus import Bus, flushed
from services.weights import WeightsError
from services.weights.buckets import LandedPrefix, bucket_plan
from services.weights.collective import (
    CollectiveReceiver,
    CollectiveSender,
)
from services.weights.stream import EncodedStream
from tests.weights.announce import announcement

Adapter = dict[str, torch.Tensor]
SETTLE_TIMEOUT = 30.0


class _ChildReply(msgspec.Struct):
    member: str
    generation: int | None = None
    error: str | None = None
    data: bytes = b""


async def _settle(sender: CollectiveSender, generation_of: dict[str, Callable[[], Any]]) -> int:
    """Wait until the sender's current generation is exactly these members, each taking part."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_TIMEOUT
    while loop.time() < deadline:
        if sorted(sender.members) == sorted(generation_of):
            generations = [await get() for get in generation_of.values()]
            if all(g == sender.generation for g in generations):
                return sender.generation
        await asyncio.sleep(0.05)
    raise AssertionError(f"group never settled: sender has {sender.members} in {sender.generation}")


@pytest.fixture
def group(uid: str) -> str:
    return f"t{uid}"


@pytest.fixture
async def sender(bus: Bus, group: str) -> AsyncIterator[CollectiveSender]:
    s = CollectiveSender(bus, "127.0.0.1", 0, bucket_bytes=4096, group=group, timeout=20.0)
    await s.start()
    yield s
    await s.close()


@pytest.fixture
async def start_receiver(nats_url: str, group: str) -> AsyncIterator[Callable[[str], Any]]:
    """In-process receivers, each with its own connection, closed after the test."""
    started: list[tuple[CollectiveReceiver, Bus]] = []

    async def start(name: str) -> CollectiveReceiver:
        bus = await Bus.connect(nats_url, "inference")
        receiver = CollectiveReceiver(bus, name, group=group, timeout=20.0, fetch_timeout=20.0)
        await receiver.start()
        started.append((receiver, bus))
        return receiver

    yield start
    for receiver, bus in started:
        await receiver.close()
        await bus.close()


class Child:
    """A receiver in a child process, driven over NATS request/reply."""

    def __init__(self, bus: Bus, proc: subprocess.Popen[bytes], control: str) -> None:
        self.bus, self.proc, self.control = bus, proc, control
        self.member = ""

    async def ask(self, payload: bytes, timeout: float = 30.0) -> _ChildReply:
        msg = await self.bus.nc.request(self.control, payload, timeout=timeout)
        return msgspec.json.decode(msg.data, type=_ChildReply)

    async def generation(self) -> int | None:
        return (await self.ask(b"member")).generation

    async def fetch(self, event: WeightsReady) -> Adapter:
        reply = await self.ask(msgspec.json.encode(event))
        if reply.error is not None:
            raise WeightsError(reply.error)
        return load_safetensors(reply.data)


@pytest.fixture
async def start_child(
    bus: Bus, nats_url: str, group: str, uid: str
) -> AsyncIterator[Callable[[str], Any]]:
    children: list[Child] = []

    async def start(name: str) -> Child:
        control = f"test.collective.{uid}.{name}"
        proc = subprocess.Popen(
            [sys.executable, __file__, "child", nats_url, group, name, control],
            env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        child = Child(bus, proc, control)
        children.append(child)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_TIMEOUT
        while not child.member:
            try:
                child.member = (await child.ask(b"member", timeout=1.0)).member
            except Exception:
                if proc.poll() is not None or loop.time() > deadline:
                    raise AssertionError(
                        f"child {name} did not start ({proc.returncode})"
                    ) from None
                await asyncio.sleep(0.1)
        return child

    yield start
    exits = {}
    for child in children:
        if child.proc.poll() is None:
            await child.ask(b"stop", timeout=20.0)
            exits[child.member] = await asyncio.to_thread(child.proc.wait, 30)
    # A replica that closes leaves its group and exits cleanly.
    assert all(code == 0 for code in exits.values()), exits


def _assert_same(got: Adapter, want: Adapter) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


# --- tests ------------------------------------------------------------------------------------


def test_bucket_plan_sends_big_pieces_alone_and_packs_small_ones() -> None:
    # Bucket 100 bytes: pieces of 50 or more go alone (views), smaller ones share buckets in
    # the order they come, a full one going out before the piece that would overfill it.
    plan = bucket_plan([10, 250, 30, 0, 70, 40, 45], 100)
    assert plan == [
        [(1, 0, 100)],
        [(1, 100, 200)],
        [(1, 200, 250)],
        [(4, 0, 70)],
        [(0, 0, 10), (2, 0, 30), (5, 0, 40)],
        [(6, 0, 45)],
    ]


def test_buckets_finishing_out_of_order_report_the_complete_prefix_in_order() -> None:
    # The same plan: segment 0 (bytes 0-10) travels in bucket 4, after segment 1's pieces.
    lengths = [10, 250, 30, 0, 70, 40, 45]
    heard: list[int] = []
    progress = LandedPrefix(lengths, bucket_plan(lengths, 100), heard.append)
    for k in range(6):
        progress.bucket_done(k)
    # Nothing is complete from the start until bucket 4 brings bytes 0-10 and 260-290; then
    # everything up to segment 6 (starting at 400) is in, and bucket 5 completes the stream.
    assert heard == [400, 445]


async def test_two_receiver_processes_get_the_senders_tensors(
    sender: CollectiveSender, start_child, make_adapter, lora: LoraSpec, run_id: str
) -> None:
    children = [await start_child("rx-a"), await start_child("rx-b")]
    await _settle(sender, {c.member: c.generation for c in children})
    for step, seed in ((1, 11), (2, 12)):
        adapter = make_adapter(seed)
        stream = EncodedStream.from_state_dict(adapter)
        where = await sender.send(run_id, step, stream)
        assert where == (
            f"collective://127.0.0.1:{sender.port}/gen{sender.generation}/{run_id}/step_{step}"
        )
        event = announcement(run_id, step, "collective", where, stream, lora)
        for child in children:
            _assert_same(await child.fetch(event), adapter)
    # The digest the replica checks is the event's: a different one is refused.
    wrong = msgspec.structs.replace(event, digest="sha256:" + "1" * 64)
    with pytest.raises(WeightsError, match="digest"):
        await children[0].fetch(wrong)


async def test_killed_receiver_is_dropped_and_survivors_keep_receiving(
    sender: CollectiveSender, start_child, make_adapter, lora: LoraSpec, run_id: str
) -> None:
    survivor, victim = await start_child("rx-live"), await start_child("rx-dead")
    before = await _settle(
        sender, {survivor.member: survivor.generation, victim.member: victim.generation}
    )
    victim.proc.send_signal(signal.SIGKILL)
    await asyncio.to_thread(victim.proc.wait, 30)
    for step, seed in ((1, 21), (2, 22)):
        adapter = make_adapter(seed)
        stream = EncodedStream.from_state_dict(adapter)
        where = await sender.send(run_id, step, stream)
        _assert_same(
            await survivor.fetch(announcement(run_id, step, "collective", where, stream, lora)),
            adapter,
        )
    # The broadcast that met the dead replica failed; the next generation is the survivor's.
    after = await _settle(sender, {survivor.member: survivor.generation})
    assert after > before
    adapter = make_adapter(23)
    stream = EncodedStream.from_state_dict(adapter)
    where = await sender.send(run_id, 3, stream)
    assert f"/gen{after}/" in where
    _assert_same(
        await survivor.fetch(announcement(run_id, 3, "collective", where, stream, lora)), adapter
    )


async def test_corrupted_or_mismatched_transfer_is_a_weights_error(
    sender: CollectiveSender, start_receiver, make_adapter, lora: LoraSpec, run_id: str
) -> None:
    receiver = await start_receiver("rx")
    await _settle(sender, {receiver.member_id: receiver.joined})
    # The bytes change after the digest was computed: what arrives does not hash to it.
    adapter = make_adapter(31)
    stream = EncodedStream.from_state_dict(adapter)
    next(iter(adapter.values())).add_(1.0)
    where = await sender.send(run_id, 1, stream)
    with pytest.raises(WeightsError, match=f"{run_id} step 1: digest mismatch"):
        await receiver.fetch(announcement(run_id, 1, "collective", where, stream, lora))
    # An event announcing other bytes than the trainer sent is refused too.
    good = make_adapter(32)
    stream = EncodedStream.from_state_dict(good)
    where = await sender.send(run_id, 2, stream)
    event = announcement(run_id, 2, "collective", where, stream, lora)
    with pytest.raises(WeightsError, match="digest"):
        await receiver.fetch(msgspec.structs.replace(event, digest="sha256:" + "2" * 64))
    with pytest.raises(WeightsError, match="not this run's transfer"):
        await receiver.fetch(msgspec.structs.replace(event, location=where.replace("2", "3")))
    # The group stayed in step through the bad transfer: the good one is intact.
    _assert_same(await receiver.fetch(event), good)


async def test_late_joiner_gets_the_current_weights_of_every_run(
    sender: CollectiveSender, start_receiver, make_adapter, lora: LoraSpec, run_id: str
) -> None:
    other_run = f"{run_id}x"
    sent: dict[tuple[str, int], tuple[Adapter, WeightsReady]] = {}

    async def send(run: str, step: int, seed: int) -> None:
        adapter = make_adapter(seed)
        stream = EncodedStream.from_state_dict(adapter)
        where = await sender.send(run, step, stream)
        sent[(run, step)] = (adapter, announcement(run, step, "collective", where, stream, lora))

    await send(run_id, 1, 41)  # nobody has joined: only kept
    early = await start_receiver("rx-early")
    await _settle(sender, {early.member_id: early.joined})
    await send(run_id, 2, 42)
    await send(other_run, 1, 43)
    late = await start_receiver("rx-late")
    await _settle(sender, {early.member_id: early.joined, late.member_id: late.joined})
    for receiver in (early, late):
        for key in ((run_id, 2), (other_run, 1)):
            adapter, event = sent[key]
            _assert_same(await receiver.fetch(event), adapter)
    # The late one never saw step 1, and is told why rather than left waiting.
    with pytest.raises(WeightsError, match="superseded"):
        await late.fetch(sent[(run_id, 1)][1])
    # A receiver that closes leaves: the next generation is the other one alone.
    await early.close()
    await _settle(sender, {late.member_id: late.joined})
    await send(other_run, 2, 44)
    adapter, event = sent[(other_run, 2)]
    _assert_same(await late.fetch(event), adapter)


async def test_receivers_join_a_restarted_sender_by_themselves(
    bus: Bus, group: str, start_receiver, make_adapter, lora: LoraSpec, run_id: str
) -> None:
    first = CollectiveSender(bus, "127.0.0.1", 0, group=group)
    await first.start()
    receiver = await start_receiver("rx")
    await _settle(first, {receiver.member_id: receiver.joined})
    await first.close()  # the trainer stops: its generation ends
    second = CollectiveSender(bus, "127.0.0.1", 0, group=group)
    await second.start()
    try:
        await _settle(second, {receiver.member_id: receiver.joined})
        adapter = make_adapter(51)
        stream = EncodedStream.from_state_dict(adapter)
        where = await second.send(run_id, 1, stream)
        assert f":{second.port}/" in where
        _assert_same(
            await receiver.fetch(announcement(run_id, 1, "collective", where, stream, lora)),
            adapter,
        )
    finally:
        await second.close()


async def test_full_weights_arrive_in_place_in_several_buckets(
    sender: CollectiveSender, start_receiver, lora: LoraSpec, run_id: str
) -> None:
    from transformers import LlamaForCausalLM

    from services.model.tiny import tiny_config

    def tiny(seed: int) -> Any:
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_config()).eval()

    source, replica = tiny(1), tiny(2)
    weights = {name: p.detach() for name, p in source.named_parameters()}
    params = dict(replica.named_parameters())
    destination = {name: p.detach() for name, p in params.items()}
    assert not torch.equal(
        params["model.embed_tokens.weight"], weights["model.embed_tokens.weight"]
    )
    stream = EncodedStream.from_state_dict(weights)
    plan = bucket_plan([len(v) for v in stream.data_segments()], sender.bucket_bytes)
    assert len(plan) > 10 and any(len(b) == 1 for b in plan) and any(len(b) > 1 for b in plan)

    receiver = await start_receiver("rx-full")
    receiver.receive_into(run_id, destination)
    await _settle(sender, {receiver.member_id: receiver.joined})
    where = await sender.send(run_id, 1, stream)
    got = await receiver.fetch(
        announcement(run_id, 1, "collective", where, stream, lora), destination=destination
    )
    assert sorted(got) == sorted(params)
    for name, param in params.items():
        assert got[name].data_ptr() == param.data_ptr(), name
        assert torch.equal(param, weights[name]), name


# --- the child process --------------------------------------------------------------------------


async def _child(url: str, group: str, name: str, control: str) -> None:
    bus = await Bus.connect(url, "inference")
    receiver = CollectiveReceiver(bus, name, group=group, timeout=20.0, fetch_timeout=20.0)
    await receiver.start()
    stop = asyncio.Event()

    async def on_msg(msg: Any) -> None:
        reply = _ChildReply(member=receiver.member_id, generation=receiver.generation)
        if msg.data == b"stop":
            stop.set()
        elif msg.data != b"member":
            event = msgspec.json.decode(msg.data, type=WeightsReady)
            try:
                reply.data = save_safetensors(await receiver.fetch(event))
            except WeightsError as exc:
                reply.error = str(exc)
        await msg.respond(msgspec.json.encode(reply))

    await bus.nc.subscribe(control, cb=on_msg)
    await flushed(bus.nc)
    await stop.wait()
    await receiver.close()
    await bus.close()


if __name__ == "__main__" and sys.argv[1:2] == ["child"]:
    asyncio.run(_child(*sys.argv[2:6]))
