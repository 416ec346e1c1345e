"""The gateway's connections: a cap, and no connection held open by saying nothing.

uvicorn serves each connection with its h11 protocol; :func:`guarded_protocol` makes a subclass
that

- refuses a connection past ``max_connections`` at once (closing it, so a flood of idle
  sockets cannot use up the process's file descriptors and starve real requests);
- closes a connection whose request head has not arrived ``header_timeout_s`` after it opened,
  or after its previous response (a client that connects and says nothing, or trickles its
  headers); uvicorn's own ``timeout_keep_alive`` closes one idle between requests, and
  :func:`services.gateway.app.read_body` bounds the body by ``body_timeout_s``.

Each refusal and each close is counted; the log says so at most once every
``LOG_EVERY_S`` seconds, however many there are. The event loop's own "socket.accept() out of
system resource" is rate-limited the same way (:func:`quiet_accept_errors`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

LOG_EVERY_S = 10.0
FD_HEADROOM = 128
"""file descriptors kept free beyond the connection cap (NATS, logs, the model's files)"""


class RateLimitedLog:
    """``log.warning`` at most once every :data:`LOG_EVERY_S`, saying how many were dropped."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._since = 0
        self._last = -LOG_EVERY_S

    def note(self, detail: str = "") -> None:
        self.count += 1
        self._since += 1
        now = time.monotonic()
        if now - self._last >= LOG_EVERY_S:
            extra = f" ({self._since} since the last note)" if self._since > 1 else ""
            log.warning("gateway: %s%s%s", self.what, f": {detail}" if detail else "", extra)
            self._last, self._since = now, 0


@dataclass
class ConnectionGuard:
    """Counts the open connections and what was refused or closed."""

    max_connections: int
    header_timeout_s: float
    open: int = 0
    refused: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog("connections refused at the cap")
    )
    timed_out: RateLimitedLog = field(
        default_factory=lambda: RateLimitedLog("connections closed: no request head in time")
    )


def connection_cap(wanted: int) -> int:
    """``wanted``, or less when the process may not open that many files (with headroom)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted + FD_HEADROOM <= soft:
        return wanted
    capped = max(16, soft - FD_HEADROOM)
    log.warning(
        "gateway: max_connections %d lowered to %d: the process may open %d files "
        "(ulimit -n); raise it to serve more",
        wanted,
        capped,
        soft,
    )
    return capped


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``guard``'s cap and request-head timeout."""

    class Guarded(H11Protocol):
        _admitted = False
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            if guard.open >= guard.max_connections:
                guard.refused.note(f"{guard.open} open, the cap is {guard.max_connections}")
                transport.abort()
                return
            self._admitted = True
            guard.open += 1
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self._admitted:
                return
            self._admitted = False
            guard.open -= 1
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request is under way: its head has arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head gets the same time

        def _arm(self) -> None:
            self._disarm()
            self._head_timer = self.loop.call_later(guard.header_timeout_s, self._too_slow)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _too_slow(self) -> None:
            self._head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                return
            guard.timed_out.note(f"after {guard.header_timeout_s:g}s")
            self.transport.close()

    return Guarded


class _AcceptErrors(logging.Filter):
    """Lets the loop's accept errors through at most once every :data:`LOG_EVERY_S`."""

    def __init__(self) -> None:
        super().__init__()
        self._last = -LOG_EVERY_S
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        if "socket.accept()" not in text and "accept" not in getattr(record, "funcName", ""):
            return True
        now = time.monotonic()
        if now - self._last < LOG_EVERY_S:
            self.dropped += 1
            return False
        self._last = now
        if self.dropped:
            record.msg = f"{text} ({self.dropped} more since the last one, not logged)"
            self.dropped = 0
        return True


def quiet_accept_errors() -> Any:
    """Rate-limit asyncio's "socket.accept() out of system resource" (it repeats for as long as
    descriptors are short, thousands of times a second); returns the filter."""
    found = next(
        (f for f in logging.getLogger("asyncio").filters if isinstance(f, _AcceptErrors)), None
    )
    if found is None:
        found = _AcceptErrors()
        logging.getLogger("asyncio").addFilter(found)
    return found
