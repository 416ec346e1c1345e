"""One generate attempt that hears from the replica holding it.

The request names a fresh inbox of this connection as its ``progress_subject``; the replica
that takes it publishes GenerateProgress there at once and every ``progress_every_s`` seconds
until it replies (the reply still comes back through NATS request/reply, so "no responders" and
the attempt's timeout work as before). Once progress has arrived, a silence of
``silence_limit(every)`` seconds means the replica is gone with the request: the attempt is
abandoned with :class:`ReplicaSilent` and a late reply, should one still come, is dropped. No
progress at all (a replica older than the field) leaves the attempt to its timeout, unless the
caller knows its replicas send progress (``expect``): then no word within the limit means the
request was lost with a replica that died before it said anything, and the attempt is abandoned
the same way.

Silence while this client's own connection is down is not the replica's: it does not count, and
the clock starts again when the connection is made again (the request goes again then, see
:func:`services.bus.reconnect.request`, and the replica that holds it speaks again).

The inbox is unsubscribed when the attempt ends, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
from nats.aio.msg import Msg

from schemas.codec import DecodeError, decode
from schemas.events import GenerateProgress, GenerateRequest, GenerateResponse
from services.bus import Bus

log = logging.getLogger(__name__)


def silence_limit(every: float) -> float:
    """Seconds without progress after which a replica that sent some is presumed dead: three
    missed beats, plus slack for a busy event loop or network."""
    return 3 * every + 2.0


class ReplicaSilent(Exception):
    """The replica holding a request stopped sending progress before it replied."""

    def __init__(self, replica: str, silent_for: float, request_id: str) -> None:
        super().__init__(
            f"replica {replica} went silent for {silent_for:.1f}s while holding request "
            f"{request_id}"
        )
        self.replica = replica
        self.silent_for = silent_for
        self.request_id = request_id


class _Heard:
    """What the progress inbox has heard: when last, and from which replica."""

    def __init__(
        self, request_id: str, on_progress: Callable[[], None], since: float | None
    ) -> None:
        self.request_id = request_id
        self.on_progress = on_progress
        self.last_at: float | None = since
        """when the replica last spoke (``since``, the send, when it is expected to)"""
        self.replica = "that took it"

    async def on_msg(self, msg: Msg) -> None:
        content_type = (msg.headers or {}).get("Content-Type")
        try:
            progress: GenerateProgress = decode(msg.data, GenerateProgress, content_type)
        except DecodeError as exc:
            log.debug("ignored a message on progress inbox %s: %s", msg.subject, exc)
            return
        if progress.request_id != self.request_id:
            return
        self.last_at = asyncio.get_running_loop().time()
        self.replica = progress.replica
        self.on_progress()

    def excuse(self) -> None:
        """Our own connection was down: the silence so far is not the replica's."""
        if self.last_at is not None:
            self.last_at = asyncio.get_running_loop().time()


async def ask_with_progress(
    bus: Bus,
    subject: str,
    request: GenerateRequest,
    *,
    timeout: float,
    every: float,
    on_progress: Callable[[], None] = lambda: None,
    expect: bool = False,
) -> GenerateResponse:
    """The reply to ``request`` on ``subject``, or :class:`ReplicaSilent` (see the module
    docstring); nats' TimeoutError and NoRespondersError as from :meth:`Bus.request`."""
    loop = asyncio.get_running_loop()
    heard = _Heard(request.request_id, on_progress, loop.time() if expect else None)
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, cb=heard.on_msg)
    limit = silence_limit(every)
    ask = msgspec.structs.replace(request, progress_subject=inbox, progress_every_s=every)
    reply = asyncio.ensure_future(bus.request(subject, ask, GenerateResponse, timeout=timeout))
    unwatch = bus.reconnects.on_reconnect(heard.excuse)
    try:
        while True:
            wait = limit if heard.last_at is None else heard.last_at + limit - loop.time()
            await asyncio.wait({reply}, timeout=max(wait, 0.0))
            if reply.done():
                return reply.result()
            if not bus.nc.is_connected:
                heard.excuse()
            elif heard.last_at is not None and loop.time() - heard.last_at >= limit:
                raise ReplicaSilent(heard.replica, loop.time() - heard.last_at, request.request_id)
    finally:
        unwatch()
        if not reply.done():
            reply.cancel()
        await asyncio.gather(reply, return_exceptions=True)
        try:
            await sub.unsubscribe()
        except Exception as exc:  # a closed connection has no subscriptions left to leak
            log.debug("unsubscribing progress inbox %s failed: %s", inbox, exc)
