"""One ordered follower: replay a stream (or part of it) in order, then follow it.

A :class:`Follower` reads a JetStream stream through an ordered consumer (ephemeral,
unacknowledged, flow-controlled, with idle heartbeats). nats-py recreates such a consumer from
the next expected sequence whenever it notices a gap, a missed heartbeat or a lost server, so a
follower survives reconnects and server restarts on its own; a reset may deliver a message twice,
so every sequence at or below the last one seen is dropped.

Each message on a subject the follower decodes is decoded to ``event_type`` (honouring its
``Content-Type``) and handed to ``on_event(seq, event, meta)``, in stream order. A message that
does not decode, or that ``on_event`` rejects by raising :class:`~schemas.codec.DecodeError`, is
reported with :meth:`Bus.report_invalid` and skipped. Every message, decoded or not, advances
:attr:`Follower.seq`, which :meth:`wait_for_seq` and :meth:`wait_until_caught_up` wait on.

A stopped follower started again resumes after the last sequence it saw. So does one whose
connection is made again: a restarted server has lost the ordered consumer (nats-py would notice
only after two missed heartbeats), so on every reconnect the follower subscribes again at once,
after the last sequence it saw, retrying while JetStream does not answer yet.

A tenant's client follows the same stream names in its own account, where the registry keeps
its views of its runs' events (:mod:`services.tenants.views`): the code is the same for every
client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Generic, Literal, TypeVar

from nats.aio.msg import Msg
from nats.js import api

from schemas.codec import DecodeError, decode
from services.bus.bus import Bus
from services.bus.last import last_message

log = logging.getLogger(__name__)

E = TypeVar("E")

Start = Literal["all", "last_per_subject"] | int
"""Where a follower starts: every message, each subject's last one, or a stream sequence."""


@dataclass(frozen=True)
class MessageMeta:
    """Where and when the stream stored a message, and the headers it carried."""

    seq: int
    subject: str
    time: datetime
    headers: Mapping[str, str]


OnEvent = Callable[[int, E, MessageMeta], None]

DecodeSubjects = Container[str] | Callable[[str], bool]
"""The subjects a follower decodes: a set of them, or a predicate on the subject."""


class Follower(Generic[E]):
    """Follows ``subject`` (a filter, wildcards allowed) on ``stream``; see the module docstring.

    ``decode_subjects``, if given, limits decoding to those subjects (a set, or a predicate that
    accepts a subject): messages on other subjects of the filter only advance :attr:`seq`
    (following a whole stream keeps :attr:`seq` comparable with the stream's last sequence while
    only some subjects matter). A reconnect, or two missed ``heartbeat`` intervals, make the
    consumer start again after :attr:`seq`.
    """

    def __init__(
        self,
        bus: Bus,
        stream: str,
        subject: str,
        event_type: Any,
        on_event: OnEvent[E],
        *,
        start: Start = "all",
        decode_subjects: DecodeSubjects | None = None,
        heartbeat: float = 5.0,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.subject = subject
        self.event_type = event_type
        self.on_event = on_event
        self.start_at: Start = start
        self.decode_subjects = decode_subjects
        self.heartbeat = heartbeat
        self._seq = 0
        self._changed = asyncio.Condition()
        self._sub: Any = None
        self._unwatch: Callable[[], None] | None = None
        self._again: asyncio.Task[None] | None = None
        self.resubscribed = 0
        """times the follower subscribed again after a reconnect"""

    @property
    def seq(self) -> int:
        """The last stream sequence received (0 before any)."""
        return self._seq

    async def start(self) -> None:
        """Subscribe (replaying from the start position, or resuming after :attr:`seq`)."""
        if self._sub is not None:
            return
        config = api.ConsumerConfig()
        start = self._seq + 1 if self._seq else self.start_at
        if start == "all":
            config.deliver_policy = api.DeliverPolicy.ALL
        elif start == "last_per_subject":
            config.deliver_policy = api.DeliverPolicy.LAST_PER_SUBJECT
        else:
            config.deliver_policy = api.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = max(1, int(start))

        async def subscribe() -> Any:
            return await self.bus.js.subscribe(
                self.subject,
                stream=self.stream,
                cb=self._on_msg,
                ordered_consumer=True,
                idle_heartbeat=self.heartbeat,
                config=config,
            )

        self._sub = await self.bus.until_available(subscribe, f"following {self.subject}")
        if self._unwatch is None:
            self._unwatch = self.bus.reconnects.on_reconnect(self._on_reconnect)

    async def stop(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None
        again, self._again = self._again, None
        if again is not None:
            again.cancel()
            await asyncio.gather(again, return_exceptions=True)
        await self._unsubscribe()

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.bus.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may be closing under us
                log.debug("follower of %s: unsubscribe failed: %s", self.subject, exc)

    def _on_reconnect(self) -> None:
        if self._again is None or self._again.done():
            self._again = asyncio.create_task(self._subscribe_again())

    async def _subscribe_again(self) -> None:
        """Subscribe again after :attr:`seq` (see the module docstring)."""
        await self._unsubscribe()
        pause = 0.1
        while True:
            try:
                await self.start()
                break
            except Exception as exc:  # JetStream not answering yet: the server is starting
                if self.bus.nc.is_closed:
                    return
                log.debug("follower of %s: subscribing again failed: %s", self.subject, exc)
                with contextlib.suppress(Exception):
                    await self._unsubscribe()
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
        self.resubscribed += 1
        log.debug("follower of %s: subscribed again after #%d", self.subject, self._seq)

    async def _on_msg(self, msg: Msg) -> None:
        md = msg.metadata
        seq = md.sequence.stream
        if seq <= self._seq:
            return  # a consumer reset may deliver a message twice
        if self._decodes(msg.subject):
            headers = dict(msg.headers or {})
            try:
                event: E = decode(msg.data, self.event_type, headers.get("Content-Type"))
                self.on_event(seq, event, MessageMeta(seq, msg.subject, md.timestamp, headers))
            except DecodeError as exc:
                await self.bus.report_invalid(msg.subject, str(exc), msg.data)
        async with self._changed:
            self._seq = seq
            self._changed.notify_all()

    def _decodes(self, subject: str) -> bool:
        wanted = self.decode_subjects
        if wanted is None:
            return True
        if callable(wanted):
            return bool(wanted(subject))
        return subject in wanted

    async def wait(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``predicate()`` holds, re-checked after each message; False on timeout."""
        if predicate():
            return True  # without yielding to the event loop: nothing else arrives meanwhile
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
            except TimeoutError:
                return False
        return True

    async def wait_for_seq(self, target: int, timeout: float) -> None:
        """Wait until stream sequence ``target`` has been received; TimeoutError if it is not."""
        if not await self.wait(lambda: self._seq >= target, timeout):
            raise TimeoutError(
                f"stream {self.stream} ({self.subject}): sequence {target} not received within "
                f"{timeout}s (have {self._seq}); is NATS reachable?"
            )

    async def last_seq(self) -> int:
        """The sequence of the stream's last message on this follower's subject (0 if none)."""
        found = await last_message(self.bus, self.stream, self.subject)
        return found.seq if found is not None else 0

    async def wait_until_caught_up(self, timeout: float = 10.0) -> None:
        """Wait until everything the stream held on the subject at this call has been received."""
        await self.wait_for_seq(await self.last_seq(), timeout)
