"""What a writer hears when a stream, bucket or store is full, and how it waits for space.

JetStream refuses a write to a stream with ``discard: new`` that reached its ``max_bytes`` with
error 10077 ("maximum bytes exceeded"; also "maximum messages [per subject] exceeded"), and
every write when the server's whole store (its ``max_file_store``, or the disk) is full with
10023 ("insufficient resources"). nats-py shows both as a bare ``ServiceUnavailableError``.
:func:`storage_full` turns them into :class:`~services.bus.errors.StorageFull`, whose message
names the stream, bucket or store, its limit, the setting that raises it and where space comes
back from; :func:`wait_while_full` is how a writer that must not lose data pauses and resumes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import nats.errors
from nats.js import JetStreamContext, api
from nats.js.errors import APIError

from schemas import subjects as sj
from services.bus.errors import StorageFull
from services.bus.retry import (
    TRANSIENT,
    ConnectionLost,
    Hint,
    Lost,
    pause,
    stopped_waiting,
    unless_lost,
    with_backoff,
)
from services.config import env_name
from services.telemetry.metrics import record_pause

log = logging.getLogger(__name__)
T = TypeVar("T")

LIMIT_REACHED = 10077
"""JetStream error code: a stream's ``max_bytes`` / ``max_msgs`` (with ``discard: new``)."""
SERVER_FULL = 10023
"""JetStream error code: the server's JetStream store is full."""
CANNOT_RESERVE = 10047
"""JetStream error code: a stream's ``max_bytes`` does not fit in what the server has left."""

STREAM_SETTINGS: dict[str, str] = {
    sj.RUNS_STREAM: "runs_max_bytes",
    sj.ROLLOUTS_STREAM: "rollouts_max_bytes",
    sj.WEIGHTS_STREAM: "weights_events_max_bytes",
    sj.ERRORS_STREAM: "errors_max_bytes",
}
"""The process setting that holds each stream's byte limit."""

_PREFIXES = {
    "plexrl.runs.": sj.RUNS_STREAM,
    "plexrl.rollouts.": sj.ROLLOUTS_STREAM,
    "plexrl.weights.": sj.WEIGHTS_STREAM,
    "plexrl.errors.": sj.ERRORS_STREAM,
}

SPACE_RETURNS: dict[str, str] = {
    sj.RUNS_STREAM: "lifecycle events are kept for good, so only a higher limit makes room",
    sj.ROLLOUTS_STREAM: (
        "the trainer frees space as it commits the batches it trained (is it running and "
        "keeping up?), and batches older than PLEXRL_ROLLOUTS_MAX_AGE_S go"
    ),
    sj.WEIGHTS_STREAM: "each run keeps its newest 8 announcements, so only a higher limit helps",
    "kv_max_bytes": "each key keeps 5 revisions, so only a higher limit (or fewer runs) helps",
    "weights_store_max_bytes": (
        "older versions of each run are deleted as new ones are stored (PLEXRL_KEEP_WEIGHTS); "
        "fewer kept versions, or deleted runs, make room"
    ),
}

FIRST_DELAY, MAX_DELAY = 0.5, 10.0
"""Seconds between tries of a write to a full store: 0.5, doubling up to 10."""
LOG_EVERY = 60.0
"""Seconds between the warnings of one paused write (the first comes at once)."""


def stream_of(subject: str) -> str | None:
    """The stream of DESIGN.md that captures ``subject``, or None."""
    for prefix, stream in _PREFIXES.items():
        if subject.startswith(prefix):
            return stream
    return None


def _full_kind(exc: BaseException) -> int | None:
    if not isinstance(exc, APIError):
        return None
    description = (exc.description or "").lower()
    if exc.err_code == LIMIT_REACHED or "maximum bytes exceeded" in description:
        return LIMIT_REACHED
    if exc.err_code == SERVER_FULL or description == "insufficient resources":
        return SERVER_FULL
    return None


def storage_full(exc: BaseException, *, where: str, setting: str, what: str) -> StorageFull | None:
    """The clear error for ``exc`` if it says that ``where`` (or the whole server) is full,
    else None. ``setting`` is the process setting (field name) of ``where``'s byte limit,
    ``what`` the write that was refused ("RolloutBatch to plexrl.rollouts.run_x")."""
    kind = _full_kind(exc)
    if kind is None:
        return None
    assert isinstance(exc, APIError)
    if kind == SERVER_FULL:
        return StorageFull(
            f"the NATS server's JetStream store is full (insufficient resources): {what} was "
            f"refused by {where}. Free disk space on the server or raise its jetstream "
            "max_file_store; keeping the sum of the PLEXRL_*_MAX_BYTES limits below the store "
            "keeps one stream from filling it for all the others",
            where=where,
            setting="",
            server=True,
        )
    variable = env_name(setting)
    name = where.split(" ")[-1]
    returns = SPACE_RETURNS.get(name) or SPACE_RETURNS.get(setting, "")
    return StorageFull(
        f"{where} is full ({exc.description}): {what} was refused. Raise {variable} (every "
        f"service applies it when it starts)" + (f"; {returns}" if returns else ""),
        where=where,
        setting=variable,
    )


@contextmanager
def full_as_error(*, where: str, setting: str, what: str) -> Iterator[None]:
    """Inside, a JetStream refusal that says ``where`` (or the server) is full is raised as
    :class:`StorageFull` (see :func:`storage_full`); any other error passes unchanged."""
    try:
        yield
    except APIError as exc:
        full = storage_full(exc, where=where, setting=setting, what=what)
        if full is None:
            raise
        raise full from exc


def reservation_error(
    exc: BaseException, where: str, setting: str, max_bytes: int
) -> StorageFull | None:
    """The clear error for a byte limit the server cannot reserve (at provisioning), or None."""
    if not isinstance(exc, APIError) or exc.err_code != CANNOT_RESERVE:
        return None
    variable = env_name(setting)
    return StorageFull(
        f"cannot give {where} a limit of {max_bytes} bytes ({variable}): the NATS server cannot "
        f"reserve it ({exc.description}; the max_bytes of all streams, buckets and stores must "
        "fit in the server's jetstream max_file_store, by default 75% of the free disk). Lower "
        f"{variable}, or give the server more storage",
        where=where,
        setting=variable,
        server=True,
    )


async def wait_while_full(
    operation: Callable[[], Awaitable[T]],
    *,
    what: str,
    full_wait: float = math.inf,
    give_up: Callable[[], bool] = lambda: False,
    stop: asyncio.Event | None = None,
) -> T:
    """``await operation()``, tried again while it raises :class:`StorageFull`: 0.5 s later,
    then twice as long each time up to 10 s, for up to ``full_wait`` seconds (0: not at all).

    The writer pauses rather than dropping what it writes: nothing was stored by a refused
    try. The first refusal is logged as a warning at once, then once a minute while it lasts,
    and the resumption too. The last :class:`StorageFull` is raised when ``full_wait`` runs out
    or ``give_up()`` is true (the connection closed for good); once ``stop`` is set, the next
    refusal ends the pause with :class:`~services.bus.errors.StoppedWaiting`.
    """
    paused_at: float | None = None
    paused_on = ""
    warned_at = -math.inf
    delay = FIRST_DELAY
    try:
        while True:
            try:
                result = await operation()
            except StorageFull as exc:
                now = time.monotonic()
                if paused_at is None:
                    paused_at, paused_on = now, exc.where
                    record_pause("store_full", paused_on, 1)
                waited = now - paused_at
                if waited >= full_wait or give_up():
                    raise
                if stop is not None and stop.is_set():
                    raise stopped_waiting(what, waited, "room in a full store", exc) from exc
                if now - warned_at >= LOG_EVERY:
                    log.warning("%s: paused for %.0fs so far, trying again: %s", what, waited, exc)
                    warned_at = now
                await pause(min(delay, full_wait - waited), stop)
                delay = min(delay * 2, MAX_DELAY)
                continue
            if paused_at is not None:
                lasted = time.monotonic() - paused_at
                log.warning("%s: resumed after %.1fs paused by a full store", what, lasted)
            return result
    finally:
        if paused_at is not None:
            record_pause("store_full", paused_on, -1)


async def durable_write(
    operation: Callable[[], Awaitable[T]],
    *,
    what: str,
    attempts: int,
    first_delay: float,
    max_delay: float,
    give_up: Callable[[], bool],
    retry_on: tuple[type[BaseException], ...] = TRANSIENT,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    full_wait: float = math.inf,
    outage_wait: float = 0.0,
    hint: Hint | None = None,
    stop: asyncio.Event | None = None,
    lost: Lost | None = None,
) -> T:
    """A write that must not be lost: transient failures retried ``attempts`` times with
    backoff (:func:`~services.bus.retry.with_backoff`), past them for up to ``outage_wait``
    seconds while JetStream is unavailable (no quorum; a service waits as long as it lasts),
    and the whole of that tried again while the store is full (:func:`wait_while_full`, up to
    ``full_wait`` seconds). ``operation`` raises :class:`StorageFull` for a full store
    (:func:`full_as_error`). Both waits end once ``stop`` is set (the service is stopping). A
    try the connection lost (``lost``) is made again at once."""
    return await wait_while_full(
        lambda: with_backoff(
            operation,
            attempts=attempts,
            first_delay=first_delay,
            max_delay=max_delay,
            retry_on=retry_on,
            give_up=give_up,
            on_retry=on_retry,
            outage_wait=outage_wait,
            what=what,
            hint=hint,
            stop=stop,
            lost=lost,
        ),
        what=what,
        full_wait=full_wait,
        give_up=give_up,
        stop=stop,
    )


async def purge_before(js: JetStreamContext, stream: str, subject: str, seq: int) -> None:
    """Remove the messages of ``subject`` stored in ``stream`` before sequence ``seq``, keeping
    that one and every later one. Best effort: a failure is logged, and the next call covers
    the same messages again."""
    if seq <= 1:
        return  # nothing before it (and a purge without a sequence would take the subject)
    try:
        await js.purge_stream(stream, seq=seq, subject=subject)
    except (TimeoutError, nats.errors.Error) as exc:
        log.info("could not purge %s below sequence %d in %s: %s", subject, seq, stream, exc)


async def acked_by_all(js: JetStreamContext, stream: str) -> int:
    """The stream sequence up to which every consumer of ``stream`` that acknowledges has
    acknowledged everything (the lowest ack floor), 0 when there is none."""
    floors: list[int] = []
    offset = 0
    while True:
        page = await js.consumers_info(stream, offset=offset)
        if not page:
            return min(floors, default=0)
        offset += len(page)
        floors += [
            info.ack_floor.stream_seq if info.ack_floor is not None else 0
            for info in page
            if info.config.ack_policy != api.AckPolicy.NONE
        ]


async def purge_consumed(
    js: JetStreamContext, stream: str, subject: str, newest: int, *, lost: Lost | None = None
) -> None:
    """Remove the messages of ``subject`` that every consumer has acknowledged, up to (not
    including) sequence ``newest``, which stays. Best effort, like :func:`purge_before`; with
    ``lost`` (:meth:`services.bus.reconnect.Reconnects.lost`) it is abandoned at a reconnect,
    when its request or answer may have gone with the old connection, instead of waiting out
    the request's timeout: the next call purges the same messages."""

    async def purge() -> None:
        try:
            floor = await acked_by_all(js, stream)
        except (TimeoutError, nats.errors.Error) as exc:
            log.info("could not read the ack floors of %s: %s", stream, exc)
            return
        await purge_before(js, stream, subject, min(newest, floor + 1))

    if lost is None:
        await purge()
        return
    try:
        await unless_lost(purge, lost)
    except ConnectionLost:
        log.info(
            "purge of %s in %s abandoned: the connection was made again meanwhile", subject, stream
        )
