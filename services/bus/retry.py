"""Retrying an operation on the bus while the server is briefly away.

A nats-server restarting, or a cluster electing a stream leader, fails requests for a few
seconds with no responders, timeouts or a closed connection; the client reconnects by itself.
Operations that are safe to repeat (a publish with a message id, a KV put of the same value, an
object written again under its key) are tried again with a doubling pause instead of failing
the service.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError

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


async def with_backoff(
    operation: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    first_delay: float,
    max_delay: float,
    retry_on: tuple[type[BaseException], ...] = TRANSIENT,
    give_up: Callable[[], bool] = lambda: False,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
) -> T:
    """``await operation()``, tried up to ``attempts`` times while it raises ``retry_on`` (or a
    JetStream :data:`IN_PROCESS` refusal), pausing ``first_delay`` seconds, then twice as long
    each time up to ``max_delay``.

    The last failure is raised, and so is one after which ``give_up()`` is true (the
    connection closed for good). ``on_retry(exc, attempt, pause)`` is told of each retry.
    """
    delay = first_delay
    caught: tuple[type[BaseException], ...] = (*retry_on, APIError)
    for attempt in range(1, attempts + 1):
        try:
            return await operation()
        except caught as exc:
            in_process = isinstance(exc, APIError) and exc.err_code == IN_PROCESS
            if not (in_process or isinstance(exc, retry_on)) or attempt == attempts or give_up():
                raise
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
    raise AssertionError("unreachable: attempts must be at least 1")
