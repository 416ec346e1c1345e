"""The wire of the ``ucx`` transport: its frames and tags, the per-loop ucxx context, bounded
waits, and the pipeline that sends or receives a stream's data pieces (the protocol is in
:mod:`services.weights.ucx`)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import struct
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from services.weights.buckets import Piece
from services.weights.errors import WeightsError

REQUEST_TAG = 1
REQUEST_BYTES = 512
REQUEST_MAGIC = b"PLXWREQ1"
REPLY = struct.Struct("<8sIIQQQ")
REPLY_MAGIC = b"PLXWREP1"
OK, UNKNOWN_TAG, BAD_REQUEST = 0, 1, 2
MAX_CHUNK_BYTES = 1 << 30
_REQUEST_HEAD = struct.Struct("<8sQH")


def import_ucxx(module: str = "ucxx") -> Any:
    """Import ucxx, with its TCP defaults in the environment first (they are read at import).

    UCX's TCP transport moves data in segments of 8 KiB (send) and 64 KiB (receive) by default;
    4 MiB segments took 256 MiB between two processes on loopback from 0.35-0.6 GB/s to
    2.1-2.3 GB/s, the speed of a plain socket on the same machine. Each is only a default:
    whatever the environment already says wins.
    """
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    os.environ.setdefault("UCX_TCP_TX_SEG_SIZE", "4m")
    os.environ.setdefault("UCX_TCP_RX_SEG_SIZE", "4m")
    return importlib.import_module(module)


_contexts: dict[asyncio.AbstractEventLoop, Any] = {}
_contexts_lock = threading.Lock()


def _context() -> Any:
    """The ucxx ApplicationContext of the running loop, created on first use."""
    loop = asyncio.get_running_loop()
    with _contexts_lock:
        ctx = _contexts.get(loop)
        if ctx is None:
            import_ucxx()
            from ucxx._lib_async import ApplicationContext

            ctx = ApplicationContext(progress_mode="thread", enable_python_future=True)
            _contexts[loop] = ctx
            _stop_notifier_on_close(loop, ctx)
    return ctx


def _stop_notifier_on_close(loop: asyncio.AbstractEventLoop, ctx: Any) -> None:
    close = loop.close

    def close_and_stop() -> None:
        ctx.stop_notifier_thread()
        close()

    loop.close = close_and_stop  # type: ignore[method-assign]
    # Interpreter shutdown joins non-daemon threads before atexit handlers run; this hook runs
    # before that join (it is how concurrent.futures stops its workers).
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):
            register(ctx.stop_notifier_thread)


def _ucx_error() -> type[Exception]:
    from ucxx.exceptions import UCXError

    return UCXError  # type: ignore[no-any-return]


def _ucx_errors() -> tuple[type[Exception], ...]:
    """What a failed or stalled transfer raises: a UCX error (the peer went away) or a timeout."""
    return (_ucx_error(), TimeoutError)


def _tag(request_id: int, index: int) -> int:
    return (request_id << 24) | index


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}"


def _drop_frames(exc: BaseException) -> None:
    """Clear the tracebacks of a ucxx error caught on an endpoint the listener accepted.

    The failed request's future keeps the exception alive from inside ucxx, and its traceback
    keeps the frames that hold the endpoint, so the endpoint is never released; an accepted
    endpoint keeps its listener alive in UCX after :meth:`UcxWeightServer.close` has dropped
    the Python listener, whose callback data is freed with it. A connection request to the
    closed port then runs the listener callback on freed memory (KeyError 'cb_func', or a
    segfault in the progress thread, or silent heap corruption)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


_orphans: set[asyncio.Future[Any]] = set()
"""Requests given up on, kept referenced until the aborted endpoint ends them."""


def _orphan(future: asyncio.Future[Any]) -> None:
    if not future.done():
        _orphans.add(future)
        future.add_done_callback(_orphans.discard)
    # Retrieve the outcome so asyncio does not log "exception was never retrieved".
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


async def _bounded(awaitable: Awaitable[Any], timeout: float) -> Any:
    """``awaitable`` within ``timeout``. A timeout does not cancel the ucxx request itself: the
    caller aborts the endpoint, which ends it, so UCX stops writing into the buffer first."""
    future = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except BaseException:
        _orphan(future)
        raise


def parse_location(where: str, location: str) -> tuple[str, int, str]:
    """``(host, port, tag)`` of ``ucx://<host>:<port>/<tag>``; WeightsError when malformed."""
    parts = urlsplit(location)
    tag = parts.path.removeprefix("/")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "ucx" or not parts.hostname or port is None or not tag:
        raise WeightsError(
            f"{where}: location {location!r} is not a UCX address (ucx://<host>:<port>/<tag>)"
        )
    return parts.hostname, port, tag


async def _pipeline(
    ep: Any,
    op: str,
    pieces: Iterable[Piece],
    request_id: int,
    window: int,
    timeout: float,
) -> None:
    """``ep.send`` or ``ep.recv`` of each data piece, ``window`` at a time, each within
    ``timeout``; each piece's follow-up runs once it is through, in order. On an error the
    endpoint is aborted, which ends the pieces still in flight before anything can free their
    buffers."""
    call = getattr(ep, op)
    in_flight: deque[tuple[asyncio.Future[Any], Callable[[], None] | None]] = deque()

    async def complete_oldest() -> None:
        future, after = in_flight.popleft()
        await _bounded(future, timeout)
        if after is not None:
            after()

    try:
        for index, (piece, after) in enumerate(pieces):
            if len(in_flight) >= window:
                await complete_oldest()
            future = asyncio.ensure_future(call(piece, tag=_tag(request_id, 2 + index)))
            in_flight.append((future, after))
        while in_flight:
            await complete_oldest()
    except BaseException:
        ep.abort()
        for future, _ in in_flight:
            _orphan(future)
        raise
