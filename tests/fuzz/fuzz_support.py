"""What every fuzz test does around the payloads: publish or request them, follow the service's
error reports, wait for the service to settle."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout

from schemas.codec import decode
from schemas.events import InvalidMessage, ServiceError
from schemas.subjects import ERRORS_STREAM, errors_subject
from services.bus import Bus, Consumer, Follower, MessageMeta
from services.bus.bus import LEADING_BYTES

from .fuzz_payloads import Wire

T = TypeVar("T")

Key = tuple[str, bytes]


def key(wire: Wire) -> Key:
    """How an InvalidMessage names a payload: its subject and leading bytes."""
    return wire.subject, wire.data[:LEADING_BYTES]


class Reports:
    """The InvalidMessage reports one service publishes on ``plexrl.errors.<service>``."""

    def __init__(self, bus: Bus, service: str) -> None:
        self.invalid: Counter[Key] = Counter()
        self._follower: Follower[InvalidMessage | ServiceError] = Follower(
            bus, ERRORS_STREAM, errors_subject(service), InvalidMessage | ServiceError, self._on
        )

    def _on(self, seq: int, event: InvalidMessage | ServiceError, meta: MessageMeta) -> None:
        if isinstance(event, InvalidMessage):
            self.invalid[(event.subject, event.leading_bytes)] += 1

    async def start(self) -> Reports:
        await self._follower.start()
        return self

    async def stop(self) -> None:
        await self._follower.stop()

    def mark(self) -> Counter[Key]:
        return Counter(self.invalid)

    def missing(self, since: Counter[Key], bad: Iterable[Wire]) -> list[Wire]:
        """The payloads of ``bad`` not reported since ``since`` (one report per payload)."""
        new = self.invalid - since
        out = []
        for wire in bad:
            if new[key(wire)] > 0:
                new[key(wire)] -= 1
            else:
                out.append(wire)
        return out

    async def expect(self, since: Counter[Key], bad: list[Wire], timeout: float = 10.0) -> None:
        """Wait until every payload of ``bad`` has been reported since ``since``."""
        await self._follower.wait(lambda: not self.missing(since, bad), timeout)
        missing = self.missing(since, bad)
        assert not missing, f"never reported as InvalidMessage: {missing}"


async def eventually(check: Callable[[], Awaitable[T]], what: str, timeout: float = 10.0) -> T:
    """Poll ``check`` until it returns a truthy value; fail saying ``what`` did not happen."""
    deadline = time.monotonic() + timeout
    value = await check()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s (last value {value!r})")
        await asyncio.sleep(0.02)
        value = await check()
    return value


async def publish(bus: Bus, wire: Wire) -> int:
    """Store ``wire`` in its stream as it is; the stream sequence it got."""
    ack = await bus.js.publish(wire.subject, wire.data, headers=wire.headers)
    return int(ack.seq)


async def request(bus: Bus, wire: Wire, timeout: float = 10.0) -> Msg:
    """Send ``wire`` as a core NATS request; the reply, or an AssertionError if none came."""
    try:
        return await bus.nc.request(wire.subject, wire.data, timeout=timeout, headers=wire.headers)
    except NatsTimeout:
        raise AssertionError(f"no answer within {timeout}s to {wire}") from None


async def settled(consumer: Consumer[Any]) -> bool:
    """Whether a service's durable consumer has every message of its filter delivered and
    settled (acknowledged or terminated): nothing waits, nothing is held or due for
    redelivery."""
    assert consumer.durable is not None
    info = await consumer.bus.js.consumer_info(consumer.stream, consumer.durable)
    return info.num_pending == 0 and info.num_ack_pending == 0


def reply_of(msg: Msg, event_type: Any) -> Any:
    """The typed reply in ``msg`` (JSON or MessagePack, as its Content-Type says)."""
    return decode(msg.data, event_type, (msg.headers or {}).get("Content-Type"))
