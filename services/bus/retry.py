"""Retrying an operation on the bus while the server is briefly away, or JetStream is down.

A nats-server restarting, or a cluster electing a stream leader, fails requests for a few
seconds with no responders, timeouts or a closed connection; the client reconnects by itself.
Operations that are safe to repeat (a publish with a message id, a KV put of the same value, an
object written again under its key, an ack) are tried again with a doubling pause instead of
failing the service.

A cluster that lost its quorum (two of three servers down) is the same to a client, for as
long as the servers stay down: every JetStream request goes unanswered, or is refused with
"JetStream system temporarily unavailable". :func:`unavailable` tells these errors apart from
the rest; with an ``outage_wait``, :func:`with_backoff` keeps trying them past its ``attempts``
for that long (a service: for as long as the loss lasts), saying once in the log that it waits
and why, and once that it resumed.

A try sent on a connection that is then made again (a restarted server) may be lost with it, its
answer never to come: with ``lost`` (:meth:`services.bus.reconnect.Reconnects.lost`), such a try
is abandoned at the reconnect and made again at once, instead of waiting out its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from nats.errors import ConnectionClosedError, ConnectionReconnectingError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError, ServiceUnavailableError

from services.bus.errors import StoppedWaiting
from services.telemetry.metrics import record_pause

log = logging.getLogger(__name__)
T = TypeVar("T")

TRANSIENT: tuple[type[BaseException], ...] = (
    NoRespondersError,
    NoStreamResponseError,
    NatsTimeout,
    ConnectionClosedError,
)
"""What a restarting server looks like to a client. On a cluster, a stream without a leader
(an election, or too few servers for a quorum) leaves a JetStream publish without responders,
which nats-py raises as :class:`NoStreamResponseError`."""

IN_PROCESS = 10158
"""JetStream's ``duplicate message id is in process``: on a cluster, a publish tried again while
the stream still proposes the first try with the same message id. Trying once more gets the
first try's outcome (stored, or a duplicate of what is stored)."""

CLUSTER_UNAVAILABLE = frozenset(
    {
        10008,  # JetStream system temporarily unavailable (no meta leader: no quorum)
        10009,  # JetStream cluster can not handle request (not the leader, or no leader)
        10118,  # stream is offline
        IN_PROCESS,
    }
)
"""JetStream error codes of a cluster that cannot answer now but will once it has a quorum."""

STORE_FULL = frozenset({10077, 10023, 10047})
"""Refusals that are a 503 too, but say a stream or the server's store is full: waiting for
them is :func:`services.bus.limits.wait_while_full`'s, with its own message."""

REPORT_AFTER = 2.0
"""Seconds an operation fails with :func:`unavailable` errors before its wait is logged (a
leader election is usually over sooner and goes unreported)."""

RECHECK_S = 1.0
"""Seconds between two looks at the servers while a stuck try waits for them to come back."""

STUCK_AFTER = 5.0
"""Seconds one try may go unanswered before the servers are looked at: a request to a stream
leader that lost its quorum may wait out its whole timeout (30 s for a chunk of an object), so
a try that long, while most servers are unreachable, is reported as a wait at once."""


@dataclass(frozen=True)
class Servers:
    """What a client sees of its servers while JetStream does not answer (:data:`Hint`)."""

    says: str
    """for the log: "JetStream has no quorum: only 1 of 3 NATS servers reachable ..." """
    quorum_lost: bool
    """a majority of the servers (or every one) is unreachable"""


Hint = Callable[[], Awaitable[Servers]]
"""Looks at the servers (:meth:`services.bus.Bus.outage_hint`)."""

Lost = Callable[[], Awaitable[None]]
"""Called as a try starts: completes once the connection the try went out on has been made
again, the try maybe lost with it (:meth:`services.bus.reconnect.Reconnects.lost`)."""


class ConnectionLost(Exception):
    """A try abandoned because the connection it went out on was made again."""


async def unless_lost(operation: Callable[[], Awaitable[T]], lost: Lost) -> T:
    """``await operation()``, or :class:`ConnectionLost` (the try cancelled) if ``lost()``
    completes first."""
    task, gone = asyncio.ensure_future(operation()), asyncio.ensure_future(lost())
    done = False
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        done = task.done()
    finally:
        gone.cancel()
        if not done:
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if not done:
        raise ConnectionLost
    return task.result()


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` is JetStream not answering for now (a server restarting, a stream
    electing a leader, a cluster without a quorum, the connection being re-established), as
    opposed to an answer (not found, bad request, a full store) or a closed connection. An
    error raised ``from`` such an error (a failed object write) is one too."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if _unavailable(exc):
            return True
        seen.add(id(exc))
        exc = exc.__cause__  # type: ignore[assignment]
    return False


def _unavailable(exc: BaseException) -> bool:
    if isinstance(exc, APIError):
        if exc.err_code in STORE_FULL:
            return False
        if exc.err_code in CLUSTER_UNAVAILABLE:
            return True
        # a 503 status without a JetStream error: no responders to a direct get or an API call
        return isinstance(exc, ServiceUnavailableError) and exc.err_code is None
    return isinstance(
        exc,
        NoRespondersError | NoStreamResponseError | TimeoutError | ConnectionReconnectingError,
    )


def _describe(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, ServiceUnavailableError) and exc.err_code is None:
        text = "503 no responders"  # nats-py's text for it ("not a JetStream message") misleads
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


class _Outage:
    """One operation's wait for JetStream: reported once (when it has failed for
    ``REPORT_AFTER`` seconds, or a try went unanswered for ``STUCK_AFTER`` seconds while most
    servers are unreachable), and once more when the operation succeeds after that."""

    def __init__(self, what: str, every: float, hint: Hint | None, started: float) -> None:
        self.what, self.every, self.hint = what, every, hint
        self.started = started
        self.reported = False

    def _reporting(self) -> None:
        self.reported = True
        record_pause("jetstream_unavailable", "jetstream", 1)

    def ended(self) -> None:
        """The wait is over, whichever way (the metric of waiting operations goes down)."""
        if self.reported:
            record_pause("jetstream_unavailable", "jetstream", -1)

    @property
    def lasted(self) -> float:
        return time.monotonic() - self.started

    async def servers(self) -> Servers:
        unknown = Servers("JetStream is unavailable (no quorum, or no server reachable?)", False)
        if self.hint is None:
            return unknown
        try:
            return await self.hint()
        except Exception as hint_failed:  # a hint is a courtesy: never fail the wait for it
            log.debug("no hint about the servers: %s", hint_failed)
            return unknown

    async def report(self, exc: BaseException, limit: float) -> None:
        if self.reported or self.lasted < REPORT_AFTER:
            return
        self._reporting()
        seen = await self.servers()
        log.warning(
            "%s: %s; waiting %s, retrying every %gs (%s)",
            self.what,
            seen.says,
            _bound(limit),
            self.every,
            _describe(exc),
        )

    async def report_stuck(self, limit: float) -> bool:
        """Report a try gone unanswered while most servers are unreachable; whether they
        are (else it is a slow answer: a big object, a busy server, not an outage)."""
        seen = await self.servers()
        if self.reported or not seen.quorum_lost:
            return seen.quorum_lost
        self._reporting()
        log.warning(
            "%s: %s; waiting %s (no answer for %.0fs yet)",
            self.what,
            seen.says,
            _bound(limit),
            self.lasted,
        )
        return True

    def resumed(self) -> None:
        if self.reported:
            log.warning("%s: JetStream answers again: resumed after %.1fs", self.what, self.lasted)


async def pause(seconds: float, stop: asyncio.Event | None) -> None:
    """Sleep ``seconds``, or less if ``stop`` is set meanwhile."""
    if stop is None:
        await asyncio.sleep(seconds)
        return
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)


def stopped_waiting(what: str, waited: float, why: str, exc: BaseException) -> StoppedWaiting:
    """The error of a wait cut short by a stop request, logged as it is made."""
    message = f"{what}: asked to stop after waiting {waited:.0f}s for {why}; not done ({exc})"
    log.warning("%s", message)
    return StoppedWaiting(message)


def _bound(limit: float) -> str:
    return "for as long as it lasts" if math.isinf(limit) else f"for up to {limit:.0f}s"


async def _watched(
    operation: Callable[[], Awaitable[T]],
    stuck: Callable[[], Awaitable[bool]],
    hint: Hint,
) -> T:
    """``await operation()``, calling ``stuck()`` once if it takes ``STUCK_AFTER`` seconds. If
    that finds most servers unreachable (the try went to a leader without its quorum, which may
    not answer before its timeout, 30 s for a chunk of an object), the servers are looked at
    every :data:`RECHECK_S` seconds, and once they are back the try is abandoned with
    :class:`ConnectionLost`, to be made again at once."""
    task = asyncio.ensure_future(operation())
    try:
        done, _ = await asyncio.wait({task}, timeout=STUCK_AFTER)
        if not done and await stuck():
            while not task.done():
                await asyncio.wait({task}, timeout=RECHECK_S)
                if not task.done() and not (await hint()).quorum_lost:
                    raise ConnectionLost
        return await task
    except BaseException:
        task.cancel()  # cancelled while waiting: the try goes too
        raise


async def with_backoff(
    operation: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    first_delay: float,
    max_delay: float,
    retry_on: tuple[type[BaseException], ...] = TRANSIENT,
    give_up: Callable[[], bool] = lambda: False,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    outage_wait: float = 0.0,
    what: str = "",
    hint: Hint | None = None,
    stop: asyncio.Event | None = None,
    lost: Lost | None = None,
) -> T:
    """``await operation()``, tried up to ``attempts`` times while it raises ``retry_on`` (or a
    JetStream :data:`IN_PROCESS` refusal), pausing ``first_delay`` seconds, then twice as long
    each time up to ``max_delay``.

    With ``outage_wait`` (seconds, ``math.inf``: no bound), a failure that says JetStream is
    :func:`unavailable` (no quorum, no responders, a timeout) is tried again past ``attempts``,
    every ``max_delay`` seconds, until that long after the operation first failed. A wait that
    lasts :data:`REPORT_AFTER` seconds is logged once as a warning naming ``what`` (and what
    ``hint()`` says of the servers), and so is the operation's success after it. So is a try
    that goes unanswered for :data:`STUCK_AFTER` seconds while ``hint()`` finds most servers
    unreachable (a request to a leader without its quorum can wait out a long timeout).

    The last failure is raised, and so is one after which ``give_up()`` is true (the
    connection closed for good). ``on_retry(exc, attempt, pause)`` is told of each retry. Once
    ``stop`` is set (the service was asked to stop), a wait for JetStream that has lasted
    :data:`REPORT_AFTER` seconds (an outage, not a leader election) ends at the next failure with
    :class:`~services.bus.errors.StoppedWaiting` instead of waiting on. With ``lost``, a try the
    connection lost (see the module docstring) is made again at once, not counted as a failure.
    """
    delay = first_delay
    outage: _Outage | None = None
    attempt = 0
    label = what or "a JetStream operation"
    tried = operation if lost is None else functools.partial(unless_lost, operation, lost)
    try:
        while True:
            attempt += 1
            started = time.monotonic()

            async def stuck(since: float = started) -> bool:
                nonlocal outage
                outage = outage or _Outage(label, max_delay, hint, since)
                return await outage.report_stuck(outage_wait)

            try:
                if outage_wait > 0 and hint is not None:
                    result = await _watched(tried, stuck, hint)
                else:
                    result = await tried()
            except ConnectionLost:
                log.debug("%s: the connection was made again; trying again at once", label)
                attempt -= 1
                continue
            except Exception as exc:
                in_process = isinstance(exc, APIError) and exc.err_code == IN_PROCESS
                retryable = in_process or isinstance(exc, retry_on)
                waits = outage_wait > 0 and unavailable(exc)
                if not (retryable or waits) or give_up():
                    raise
                if waits:
                    outage = outage or _Outage(label, max_delay, hint, started)
                    if outage.lasted >= outage_wait:
                        raise
                    if stop is not None and stop.is_set() and outage.lasted >= REPORT_AFTER:
                        raise stopped_waiting(label, outage.lasted, "JetStream", exc) from exc
                    await outage.report(exc, outage_wait)
                elif attempt >= attempts:
                    raise
                if attempt >= attempts:
                    delay = max_delay  # past the quick retries: steady tries while the loss lasts
                if on_retry is not None and (outage is None or not outage.reported):
                    on_retry(exc, attempt, delay)
                wait = delay if outage is None else min(delay, outage_wait - outage.lasted)
                # a stop cuts short only the pauses of a reported outage (a blip's are short)
                await pause(
                    max(wait, 0.0), stop if outage is not None and outage.reported else None
                )
                delay = min(delay * 2, max_delay)
                continue
            if outage is not None:
                outage.resumed()
            return result
    finally:
        if outage is not None:
            outage.ended()
