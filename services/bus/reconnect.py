"""What a connection's reconnects mean for the work in flight, and the request that survives one.

A nats-server restarted (or a connection cut and made again) loses what was in flight on the
old connection: a request or its reply, a message a consumer was handed, an ack. nats-py
reconnects by itself and replays its subscriptions, but nothing tells the work waiting on the old
connection that it will wait in vain: a request waits out its timeout, a pull consumer's
message its ``ack_wait``, an ordered consumer two missed heartbeats. :class:`Reconnects` counts
a connection's reconnects (the bus calls :meth:`Reconnects.reconnected` from nats-py's
callback) and tells whoever asked, at once; each then re-sends or re-subscribes what the lost
connection carried, and the receiver is idempotent.

:func:`request` is a request/reply that re-sends its request, unchanged, on every reconnect
while it waits for the reply, instead of waiting out its timeout: the request may have been
lost on its way, or its reply on the way back. Receivers answer a request they see twice once:
inference generates once per request id, the trainer applies a training command once per
request id, the registry's list is a read.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.bus.retry import ConnectionLost, unless_lost

log = logging.getLogger(__name__)

Listener = Callable[[], None]

RESPONDERS_GRACE = 10.0
"""seconds after a reconnect during which a request that finds no responders is sent again:
its responders lost their connection too, and may not have made it again yet"""


class Reconnects:
    """The reconnects of one connection: how many, and who wants to hear of the next."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.count = 0
        """reconnects completed since the first connection"""
        self._changed: asyncio.Event | None = None
        self._listeners: list[Listener] = []

    def reconnected(self) -> None:
        """nats-py made the connection again (subscriptions replayed, buffered data flushed):
        wake every waiter and call every listener."""
        self.count += 1
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:  # one listener's failure must not keep the others from hearing
                log.exception("a reconnect listener failed")

    def on_reconnect(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener()`` (from the event loop; it must not block) after every reconnect;
        the function returned stops it."""
        self._listeners.append(listener)

        def remove() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return remove

    def epoch(self) -> int:
        """The reconnect count after which something sent now is no longer in flight: the
        current one while connected; the next while reconnecting, as nats-py sends what it
        buffered meanwhile once it has reconnected."""
        return self.count if self.nc.is_connected else self.count + 1

    def lost(self) -> Awaitable[None]:
        """Called as something is sent: completes once it may have been lost with the
        connection (:data:`services.bus.retry.Lost`)."""
        return self.wait_past(self.epoch())

    async def request(
        self, subject: str, data: bytes, timeout: float, headers: dict[str, str], what: str
    ) -> Msg:
        """:func:`request` on this connection."""
        return await request(self, subject, data, timeout=timeout, headers=headers, what=what)

    async def wait_past(self, epoch: int) -> None:
        """Return once more than ``epoch`` reconnects have completed."""
        while self.count <= epoch:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()


async def request(
    reconnects: Reconnects,
    subject: str,
    data: bytes,
    *,
    timeout: float,
    headers: dict[str, str] | None = None,
    what: str = "",
) -> Msg:
    """``nc.request(subject, data)`` on the connection of ``reconnects``, sent again unchanged
    after each reconnect while no reply has come, all within ``timeout`` seconds (then nats'
    TimeoutError, as from ``nc.request``). A late reply to an earlier send is dropped by
    nats-py: only the newest send is listened to. For :data:`RESPONDERS_GRACE` seconds after a
    reconnect, "no responders" is tried again (the responders are reconnecting too); otherwise
    it is raised as from ``nc.request``.
    """
    nc, loop = reconnects.nc, asyncio.get_running_loop()
    deadline = loop.time() + timeout
    sends = 0
    grace_until = 0.0
    while True:
        left = deadline - loop.time()
        if left <= 0:
            raise NatsTimeout
        sends += 1
        try:
            ask = functools.partial(nc.request, subject, data, timeout=left, headers=headers)
            return await unless_lost(ask, reconnects.lost)
        except NoRespondersError:
            if loop.time() >= grace_until:
                raise
            await asyncio.sleep(min(0.1 * sends, 1.0))
        except ConnectionLost:
            grace_until = loop.time() + RESPONDERS_GRACE
            log.info(
                "%s on %s: the connection was made again while waiting for the reply; sending "
                "it again (send %d, %.1fs left)",
                what or "request",
                subject,
                sends + 1,
                deadline - loop.time(),
            )
