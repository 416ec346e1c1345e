"""Fuzzing the collective transport's membership subjects: join and leave requests (answered by
the trainer's CollectiveSender) and the GroupFormed announcements every replica's receiver
follows.

Every malformed request is answered at once with a ServiceError saying why (not left to its
timeout) and every malformed announcement skipped; each is reported as InvalidMessage on
``plexrl.errors.<service>``. Around them the group goes on: after each batch the sender
broadcasts an adapter and the member receives it, bit for bit, in the generation it was in.
Requests that decode (a join from a replica nobody runs) are not thrown: they are valid, and
what they change is the sender's business, tested in tests/weights/test_weights_collective.py.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schemas.collective import GroupFormed, JoinRequest, LeaveRequest
from schemas.events import LoraSpec, ServiceError
from schemas.subjects import collective_subjects
from services.bus import Bus, EmbeddedNats
from services.weights.collective import CollectiveReceiver, CollectiveSender
from services.weights.stream import EncodedStream
from tests.weights.announce import announcement

from .fuzz_payloads import Thrown, Wire, decodes, fuzz, wires
from .fuzz_support import Reports, eventually, reply_of, request

GROUP = "fuzz"
SUBJECTS = collective_subjects(GROUP)
LORA = LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"])
RUN = "run_fuzz"

JOINS = wires(st.just(SUBJECTS.join), JoinRequest(member="m-fuzz", replica="fuzz"))
LEAVES = wires(st.just(SUBJECTS.leave), LeaveRequest(member="m-fuzz"))
FORMED = wires(
    st.just(SUBJECTS.formed),
    GroupFormed(sender="s-fuzz", generation=1, host="127.0.0.1", port=1, members=["m-fuzz"]),
)
KIND = {"join": JoinRequest, "leave": LeaveRequest, "formed": GroupFormed}
THROWN = st.one_of(
    st.builds(Thrown, st.just("join"), JOINS),
    st.builds(Thrown, st.just("leave"), LEAVES),
    st.builds(Thrown, st.just("formed"), FORMED),
).filter(lambda t: decodes(t.wire, KIND[t.target]) is None)


@dataclass
class Group:
    sender: CollectiveSender
    receiver: CollectiveReceiver
    bus: Bus
    trainer: Reports
    inference: Reports
    steps: itertools.count[int]


@pytest.fixture
async def group(server: EmbeddedNats, fbus: Bus) -> AsyncIterator[Group]:
    tx_bus = await Bus.connect(server.url, "trainer")
    rx_bus = await Bus.connect(server.url, "inference")
    sender = CollectiveSender(tx_bus, "127.0.0.1", 0, bucket_bytes=4096, group=GROUP, timeout=20.0)
    await sender.start()
    receiver = CollectiveReceiver(rx_bus, "rx", group=GROUP, timeout=20.0, fetch_timeout=20.0)
    await receiver.start()
    trainer = await Reports(fbus, "trainer").start()
    inference = await Reports(fbus, "inference").start()

    async def joined() -> bool:
        return sender.members == [receiver.member_id] and receiver.generation == sender.generation

    await eventually(joined, "the receiver in the sender's generation", timeout=30.0)
    yield Group(sender, receiver, fbus, trainer, inference, itertools.count(1))
    await inference.stop()
    await trainer.stop()
    await receiver.close()
    await sender.close()
    await rx_bus.close()
    await tx_bus.close()


async def _throw(g: Group, thrown: Thrown) -> None:
    wire: Wire = thrown.wire
    if thrown.target == "formed":
        await g.bus.nc.publish(wire.subject, wire.data, headers=wire.headers)
        return
    answer = reply_of(await request(g.bus, wire, 5.0), ServiceError)
    name = KIND[thrown.target].__name__
    assert answer.error.startswith(f"invalid {name}: "), (wire, answer)
    assert answer.service == "trainer" and answer.context == {"subject": wire.subject}


@fuzz(20)
@given(batch=st.lists(THROWN, min_size=1, max_size=6))
async def test_bad_membership_messages_are_answered_reported_and_the_group_goes_on(
    group: Group, batch: list[Thrown]
) -> None:
    g = group
    since_trainer, since_inference = g.trainer.mark(), g.inference.mark()
    generation = g.sender.generation
    for thrown in batch:
        await _throw(g, thrown)

    step = next(g.steps)
    adapter = {"lora_A": torch.full((2, 8), float(step)), "lora_B": torch.arange(16.0).view(8, 2)}
    stream = EncodedStream.from_state_dict(adapter)
    where = await g.sender.send(RUN, step, stream)
    event = announcement(RUN, step, "collective", where, stream, LORA)
    got = await g.receiver.fetch(event)
    assert sorted(got) == sorted(adapter)
    assert all(torch.equal(got[k], v) for k, v in adapter.items())
    assert g.sender.generation == generation and g.sender.members == [g.receiver.member_id]

    await g.trainer.expect(since_trainer, [t.wire for t in batch if t.target != "formed"])
    await g.inference.expect(since_inference, [t.wire for t in batch if t.target == "formed"])
