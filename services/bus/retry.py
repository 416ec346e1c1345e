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

T = TypeVar("T")

TRANSIENT: tuple[type[BaseException], ...] = (NoRespondersError, NatsTimeout, ConnectionClosedError)
"""What a restarting server looks like to a client."""


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
    """``await operation()``, tried up to ``attempts`` times while it raises ``retry_on``,
    pausing ``first_delay`` seconds, then twice as long each time up to ``max_delay``.

    The last failure is raised, and so is one after which ``give_up()`` is true (the
    connection closed for good). ``on_retry(exc, attempt, pause)`` is told of each retry.
    """
    delay = first_delay
    for attempt in range(1, attempts + 1):
        try:
            return await operation()
        except retry_on as exc:
            if attempt == attempts or give_up():
                raise
            if on_retry is not None:
                on_retry(exc, attempt, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay)
    raise AssertionError("unreachable: attempts must be at least 1")
