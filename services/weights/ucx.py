"""The ``ucx`` weight transport: weights straight from the trainer's memory to each replica.

Location: a WeightsReady with ``transport = "ucx"`` has ``location`` =
``ucx://<host>:<port>/<run_id>/step_<n>``: the address of the trainer's UCX listener and the tag
under which it holds that version's safetensors stream (an adapter, or a whole model's state
dict). The trainer keeps the last ``keep_last`` versions of each run in memory (no disk, no
object store; of a full-weight run the publisher keeps only the newest); a replica connects and
pulls, into fresh tensors or in place into a ``destination``. TCP on
one host, RDMA across hosts when ``UCX_TLS`` allows it: this module sets ``UCX_TLS=tcp`` and
``UCX_WARN_UNUSED_ENV_VARS=n`` only where they are unset, so set ``UCX_TLS`` (for instance
``rc,tcp``) to use other transports.

Protocol, on one UCX endpoint per replica and trainer, in tagged messages; every message has a
tag of its own, so nothing depends on their order and requests on one endpoint run at once:

1. replica -> trainer, tag 1: a request frame of :data:`REQUEST_BYTES` bytes: magic
   ``PLXWREQ1``, u64 request id ``r``, u16 length of the tag, the tag in UTF-8, zero padding;
   the frame's last byte holds flags (:data:`WANTS_BUCKETS`; a replica that predates them
   leaves it 0).
2. trainer -> replica, tag ``r << 24``: a reply frame (:data:`REPLY`): magic ``PLXWREP1``, u32
   status (0 ok, 1 unknown tag, 2 bad request), u32 flags (:data:`BUCKETS`, else 0), u64
   header length (with its 8-byte prefix), u64 stream size, u64 chunk size. A status other
   than 0 ends the reply.
3. trainer -> replica, tag ``r << 24 | 1``: the safetensors header.
4. trainer -> replica, tag ``r << 24 | 2 + k``: piece ``k`` of the tensor data. With
   :data:`BUCKETS` the pieces are the buckets of :func:`services.weights.stream.bucket_plan`
   with that chunk size: large tensors in pieces of their own, received in place, and the
   pieces of small tensors put together, copied through a buffer on both ends, so that an
   adapter of hundreds of small tensors takes a few messages rather than one per tensor (one
   message per tensor ran a 56 MB adapter of 448 tensors at half the speed of one tensor).
   Without it, pieces are cut as :func:`services.weights.stream.split` cuts them. The replica
   cuts its :meth:`StreamDecoder.targets` the same way.

Both ends keep a few pieces in flight (``window``). A replica checks size and digest when the
last piece is in (:meth:`StreamDecoder.finish`). Every wait is bounded: connecting by
``connect_timeout`` (ucxx usually reports a refused connection at once, but now and then only
as that timeout), each message by ``stall_timeout`` (a peer that stops sending for that long
is given up on). A trainer that dies mid-transfer resets the connection, which fails the
transfer at once; either way the replica aborts the endpoint (so nothing more is written into
its buffers), drops it from its cache and raises :class:`WeightsError`, with ``touched`` set
when pieces were already being received into a destination; the next fetch reconnects.

asyncio: ucxx's asyncio API runs here in its ``thread`` progress mode with Python futures: a UCX
progress thread drives the worker, and a notifier thread completes each request's asyncio future
on the event loop, so an idle endpoint costs nothing and nats-py shares the loop undisturbed.
(Without Python futures every awaited request polls with ``asyncio.sleep(0)``, which keeps a core
busy for as long as a replica waits.) There is one ucxx context per event loop, made on first use:
ucxx keeps its progress tasks in a global dictionary keyed by loop, so a second context on the
same loop would never progress. The notifier thread is not a daemon; it is stopped when its loop
closes and before interpreter shutdown joins threads, or the process would hang on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import itertools
import logging
import os
import struct
import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from torch import Tensor

from schemas.events import WeightsReady
from schemas.subjects import weights_object_key
from services.weights.errors import TransportUnavailable, WeightsError
from services.weights.stream import (
    CHUNK_BYTES,
    MAX_HEADER_BYTES,
    EncodedStream,
    Piece,
    StreamDecoder,
    bucket_pieces,
    split,
)

log = logging.getLogger(__name__)

REQUEST_TAG = 1
REQUEST_BYTES = 512
REQUEST_MAGIC = b"PLXWREQ1"
REPLY = struct.Struct("<8sIIQQQ")
REPLY_MAGIC = b"PLXWREP1"
OK, UNKNOWN_TAG, BAD_REQUEST = 0, 1, 2
MAX_CHUNK_BYTES = 1 << 30
WANTS_BUCKETS = 1
"""Request flag: this replica can take the data cut by bucket plan."""
BUCKETS = 1
"""Reply flag: the data comes cut by bucket plan (else as ``split`` cuts it)."""
_REQUEST_HEAD = struct.Struct("<8sQH")
_FLAGS_AT = REQUEST_BYTES - 1


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


# --- trainer side -------------------------------------------------------------------------------


class UcxWeightServer:
    """The trainer's UCX listener: holds each run's newest streams and serves them on request.

    ``host`` is the address replicas connect to, written into each location; the listener
    accepts on every interface. ``port`` 0 takes a free one (see :attr:`port` after
    :meth:`start`).
    """

    name = "ucx"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        keep_last: int = 3,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        window: int = 4,
        stall_timeout: float = 30.0,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        self.host = host
        self.port = port
        self.keep_last = keep_last
        self.chunk_bytes = chunk_bytes
        self.window = max(1, window)
        self.stall_timeout = stall_timeout
        self._streams: dict[str, OrderedDict[int, EncodedStream]] = {}
        self._listener: Any = None
        self._endpoints: set[Any] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Listen; idempotent. TransportUnavailable when ucxx or the port cannot be had."""
        if self._listener is None:
            try:
                ctx = _context()
                self._listener = ctx.create_listener(self._serve_endpoint, port=self.port)
            except Exception as exc:
                if not isinstance(exc, ImportError | _ucx_error()):
                    raise
                raise TransportUnavailable(
                    f"cannot listen for UCX weight transfers on port {self.port}: {_describe(exc)}"
                ) from exc
            self.port = int(self._listener.port)
            log.info(
                "ucx weight server listening on port %d (advertised as %s)", self.port, self.host
            )

    async def send(self, run_id: str, step: int, stream: EncodedStream) -> str:
        """Hold ``stream`` under ``<run_id>/step_<n>``; the location replicas fetch it from."""
        await self.start()
        tag = weights_object_key(run_id, step)
        versions = self._streams.setdefault(run_id, OrderedDict())
        versions.pop(step, None)
        versions[step] = stream
        while len(versions) > self.keep_last:
            versions.popitem(last=False)
        return f"ucx://{self.host}:{self.port}/{tag}"

    async def forget(self, run_id: str, steps: Collection[int]) -> None:
        versions = self._streams.get(run_id)
        if versions is None:
            return
        for step in steps:
            versions.pop(step, None)
        if not versions:
            del self._streams[run_id]

    def held(self, run_id: str) -> list[int]:
        """The steps of ``run_id`` held now, oldest first."""
        return list(self._streams.get(run_id, ()))

    async def close(self) -> None:
        """Stop listening and drop every connection; transfers under way fail on the replica."""
        listener, self._listener = self._listener, None
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ep in list(self._endpoints):
            ep.abort()  # ends each connection's handler, which waits for the next request
        self._endpoints.clear()
        if listener is not None:
            # Closing the listener under a live handler makes ucxx warn; they end in a moment.
            for _ in range(100):
                if not listener.active_clients:
                    break
                await asyncio.sleep(0.01)
            listener.close()

    def _lookup(self, tag: str) -> EncodedStream | None:
        run_id, _, step = tag.rpartition("/step_")
        if not step.isdigit():
            return None
        versions = self._streams.get(run_id)
        return None if versions is None else versions.get(int(step))

    async def _serve_endpoint(self, ep: Any) -> None:
        """One replica's connection: take its requests until it goes away."""
        errors = _ucx_errors()
        self._endpoints.add(ep)
        try:
            while self._listener is not None:
                frame = bytearray(REQUEST_BYTES)
                try:
                    await ep.recv(memoryview(frame), tag=REQUEST_TAG)
                except errors as exc:
                    _drop_frames(exc)
                    return  # the replica closed its endpoint or died
                task = asyncio.create_task(self._serve_request(ep, bytes(frame)))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except asyncio.CancelledError:
            pass
        finally:
            self._endpoints.discard(ep)

    async def _serve_request(self, ep: Any, frame: bytes) -> None:
        magic, request_id, length = _REQUEST_HEAD.unpack_from(frame)
        tag_bytes = frame[_REQUEST_HEAD.size : _REQUEST_HEAD.size + length]
        try:
            if magic != REQUEST_MAGIC or len(tag_bytes) != length:
                await self._reply(ep, request_id, BAD_REQUEST)
                return
            tag = tag_bytes.decode("utf-8", "replace")
            stream = self._lookup(tag)
            if stream is None:
                await self._reply(ep, request_id, UNKNOWN_TAG)
                return
            buckets = bool(frame[_FLAGS_AT] & WANTS_BUCKETS)
            await self._reply(ep, request_id, OK, stream, BUCKETS if buckets else 0)
            await self._send_stream(ep, request_id, stream, buckets)
        except _ucx_errors() as exc:
            # The replica went away or stalled; it sees its own error. Aborting makes sure no
            # send of this request stays posted.
            log.info("ucx weight server: request %d failed: %s", request_id, _describe(exc))
            self._endpoints.discard(ep)
            ep.abort()
            _drop_frames(exc)

    async def _send_stream(
        self, ep: Any, request_id: int, stream: EncodedStream, buckets: bool
    ) -> None:
        """The header, then the data pieces, each on its own tag."""
        await _bounded(
            ep.send(memoryview(stream.header), tag=_tag(request_id, 1)), self.stall_timeout
        )
        pieces = _pieces(stream.data_segments(), self.chunk_bytes, buckets, sending=True)
        await _pipeline(ep, "send", pieces, request_id, self.window, self.stall_timeout)

    async def _reply(
        self,
        ep: Any,
        request_id: int,
        status: int,
        stream: EncodedStream | None = None,
        flags: int = 0,
    ) -> None:
        header, size = (len(stream.header), stream.size) if stream is not None else (0, 0)
        frame = REPLY.pack(REPLY_MAGIC, status, flags, header, size, self.chunk_bytes)
        await _bounded(ep.send(memoryview(frame), tag=_tag(request_id, 0)), self.stall_timeout)


def _pieces(
    views: Sequence[memoryview],
    chunk_bytes: int,
    buckets: bool,
    *,
    sending: bool,
    landed: Callable[[int], None] | None = None,
) -> Iterator[Piece]:
    """The data's messages in order, made as they are posted (so only the pieces in flight
    hold a buffer): by :func:`bucket_pieces` when ``buckets``, else as :func:`split` cuts it;
    ``landed`` hears the stream-order prefix of bytes in place."""
    if buckets:
        yield from bucket_pieces(views, chunk_bytes, sending=sending, landed=landed)
        return
    done = 0
    for view in split(views, chunk_bytes):
        done += len(view)
        yield view, (None if landed is None else functools.partial(landed, done))


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


# --- inference side -----------------------------------------------------------------------------


class _Stale(Exception):
    """A cached endpoint failed before the reply: the trainer may have restarted; reconnect."""


class _Refused(WeightsError):
    """The trainer answered with an error status; the endpoint is fine for other requests."""


class UcxWeightClient:
    """Fetches ``ucx`` weights for one replica; one cached endpoint per trainer address."""

    def __init__(
        self,
        *,
        connect_timeout: float = 5.0,
        stall_timeout: float = 30.0,
        window: int = 4,
    ) -> None:
        self.connect_timeout = connect_timeout
        self.stall_timeout = stall_timeout
        self.window = max(1, window)
        self._endpoints: dict[tuple[str, int], Any] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._ids = itertools.count(1)

    async def fetch(
        self, event: WeightsReady, destination: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The tensors ``event`` announces, received in place and checked; WeightsError if not.

        With ``destination`` they are received into its tensors, which must be exactly the
        stream's (checked from the header, before a byte is written)."""
        where = f"weights for {event.run_id} step {event.step}"
        host, port, tag = parse_location(where, event.location)
        errors = _ucx_errors()
        for attempt in (1, 2):
            ep, cached = await self._endpoint(where, host, port)
            decoder = StreamDecoder(where, event.size_bytes, event.digest, destination)
            try:
                await self._transfer(
                    where, f"ucx://{host}:{port}", ep, tag, decoder, cached=cached and attempt == 1
                )
                break
            except _Stale:
                decoder.abandon()
                self._drop(host, port, ep)
            except _Refused:
                decoder.abandon()
                raise
            except BaseException as exc:
                # Whatever ended the transfer (cancellation included), no receive may stay
                # posted into buffers that are about to be dropped.
                decoder.abandon()
                self._drop(host, port, ep)
                if not isinstance(exc, errors):
                    raise
                raise WeightsError(
                    f"{where}: transfer from ucx://{host}:{port} failed ({_describe(exc)}); the "
                    "trainer may have stopped or restarted, a later announcement will be fetched "
                    "afresh",
                    touched=decoder.touched,
                ) from exc
        return await asyncio.to_thread(decoder.finish)

    async def close(self) -> None:
        endpoints, self._endpoints = list(self._endpoints.values()), {}
        for ep in endpoints:
            await ep.close()

    async def _endpoint(self, where: str, host: str, port: int) -> tuple[Any, bool]:
        """``(endpoint, whether it was cached)`` for the trainer at ``host:port``."""
        key = (host, port)
        async with self._locks.setdefault(key, asyncio.Lock()):
            ep = self._endpoints.get(key)
            if ep is not None and not ep.closed:
                return ep, True
            try:
                ep = await asyncio.wait_for(
                    _context().create_endpoint(host, port, connect_timeout=self.connect_timeout),
                    self.connect_timeout + 1.0,
                )
            except _ucx_errors() as exc:
                raise WeightsError(
                    f"{where}: cannot connect to the trainer at ucx://{host}:{port} "
                    f"({_describe(exc)}); is it running and is the address reachable?"
                ) from exc
            self._endpoints[key] = ep
            return ep, False

    def _drop(self, host: str, port: int, ep: Any) -> None:
        if self._endpoints.get((host, port)) is ep:
            del self._endpoints[(host, port)]
        ep.abort()

    async def _transfer(
        self, where: str, address: str, ep: Any, tag: str, decoder: StreamDecoder, *, cached: bool
    ) -> None:
        request_id = next(self._ids)
        encoded = tag.encode()
        if _REQUEST_HEAD.size + len(encoded) > _FLAGS_AT:
            raise WeightsError(f"{where}: tag {tag!r} is too long for a request")
        frame = bytearray(REQUEST_BYTES)
        _REQUEST_HEAD.pack_into(frame, 0, REQUEST_MAGIC, request_id, len(encoded))
        frame[_REQUEST_HEAD.size : _REQUEST_HEAD.size + len(encoded)] = encoded
        frame[_FLAGS_AT] = WANTS_BUCKETS
        reply = bytearray(REPLY.size)
        try:
            await _bounded(ep.send(memoryview(frame), tag=REQUEST_TAG), self.stall_timeout)
            await _bounded(ep.recv(memoryview(reply), tag=_tag(request_id, 0)), self.stall_timeout)
        except _ucx_errors():
            if cached:
                raise _Stale() from None
            raise
        magic, status, flags, header_len, size, chunk_bytes = REPLY.unpack(reply)
        if magic != REPLY_MAGIC:
            raise WeightsError(f"{where}: {address} answered with a malformed reply {magic!r}")
        if status == UNKNOWN_TAG:
            raise _Refused(
                f"{where}: the trainer at {address} holds no weights under tag {tag!r} (never "
                "sent there, dropped after newer steps were published, or the trainer restarted)"
            )
        if status != OK:
            raise _Refused(
                f"{where}: the trainer at {address} refused the request for {tag!r} "
                f"(status {status})"
            )
        if size != decoder.size:
            raise WeightsError(
                f"{where}: size mismatch: announced {decoder.size} bytes, the trainer at "
                f"{address} holds {size} under {tag!r}"
            )
        if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise WeightsError(f"{where}: {address} announced a chunk size of {chunk_bytes}")
        if not 10 <= header_len <= min(size, MAX_HEADER_BYTES + 8):
            raise WeightsError(
                f"{where}: {address} announced a {header_len}-byte header for a {size}-byte "
                "stream, which cannot be"
            )
        header = bytearray(header_len)
        await _bounded(ep.recv(memoryview(header), tag=_tag(request_id, 1)), self.stall_timeout)
        decoder.feed_header(bytes(header))
        pieces = _pieces(
            decoder.targets(),
            chunk_bytes,
            bool(flags & BUCKETS),
            sending=False,
            landed=decoder.landed,
        )
        await _pipeline(ep, "recv", pieces, request_id, self.window, self.stall_timeout)


_default_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, UcxWeightClient] = (
    weakref.WeakKeyDictionary()
)


def default_client() -> UcxWeightClient:
    """The running loop's shared client (endpoints belong to one loop's ucxx context)."""
    loop = asyncio.get_running_loop()
    client = _default_clients.get(loop)
    if client is None:
        client = _default_clients[loop] = UcxWeightClient()
    return client
