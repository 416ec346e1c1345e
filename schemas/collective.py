"""Membership of a ``collective`` weight-transport group: who receives the trainer's broadcasts.

Core NATS request/reply and plain messages, no stream, on ``plexrl.collective.<group>.*``
(:func:`schemas.subjects.collective_subjects`; ``<group>`` is ``default`` unless both ends are
told otherwise). The weights themselves travel in a torch.distributed group these messages form,
not on the bus. Each message is an :class:`~schemas.events.Event`: tagged by ``type``, carrying
``schema_version``, tolerant of unknown fields.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from schemas.events import Event

MemberId = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[A-Za-z0-9_-]{1,64}(?!\n)$",
        description="a replica's member id: 1-64 letters, digits, '_' or '-'",
    ),
]
Generation = Annotated[int, msgspec.Meta(ge=0, description="0: no group formed yet")]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]


class JoinRequest(Event, frozen=True, kw_only=True, tag="collective_join"):
    """A replica asks to receive weights; the answer is a GroupState.

    Producer: an inference replica's CollectiveReceiver. Consumer: the trainer's
    CollectiveSender, which forms the next generation of every live member plus the joiner.
    Subject: ``plexrl.collective.<group>.join``.
    """

    member: MemberId
    replica: str


class LeaveRequest(Event, frozen=True, kw_only=True, tag="collective_leave"):
    """A replica that closes; the answer is a GroupState.

    Producer: CollectiveReceiver. Consumer: CollectiveSender.
    Subject: ``plexrl.collective.<group>.leave``.
    """

    member: MemberId


class GroupState(Event, frozen=True, kw_only=True, tag="collective_state"):
    """The answer to a join or leave: which sender, its current generation, its store's address.

    Producer: CollectiveSender. Consumer: the CollectiveReceiver that asked.
    """

    sender: str
    generation: Generation
    host: str
    port: Port


class GroupFormed(Event, frozen=True, kw_only=True, tag="collective_formed"):
    """Generation ``generation`` is being built: ``members[i]`` takes rank ``i + 1``.

    Producer: CollectiveSender, before it builds the group. Consumers: every CollectiveReceiver
    of the group. Subject: ``plexrl.collective.<group>.formed``.
    """

    sender: str
    generation: Generation
    host: str
    port: Port
    members: list[MemberId]


class Ping(Event, frozen=True, kw_only=True, tag="collective_ping"):
    """Are you still there? Asked after a failed broadcast; the answer is a Pong.

    Producer: CollectiveSender. Consumer: one CollectiveReceiver.
    Subject: ``plexrl.collective.<group>.alive.<member>``.
    """

    generation: Generation


class Pong(Event, frozen=True, kw_only=True, tag="collective_pong"):
    """Yes: the member's receiving thread is alive.

    Producer: CollectiveReceiver. Consumer: CollectiveSender, which keeps the members that answer.
    """

    member: MemberId


COLLECTIVE_MESSAGES: tuple[type[Event], ...] = (
    JoinRequest,
    LeaveRequest,
    GroupState,
    GroupFormed,
    Ping,
    Pong,
)
"""Every collective membership message; exported beside the events (``schemas/json``)."""

CollectiveMessage = JoinRequest | LeaveRequest | GroupState | GroupFormed | Ping | Pong
