"""The trainer's end of the ``ucx`` transport: :class:`UcxWeightServer`."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Collection
from typing import Any

from schemas.subjects import weights_object_key
from schemas.tenant import DEFAULT_TENANT
from services.weights.buckets import bucket_pieces
from services.weights.errors import TransportUnavailable
from services.weights.stream import CHUNK_BYTES, EncodedStream
from services.weights.ucx.wire import (
    _REQUEST_HEAD,
    BAD_REQUEST,
    MAX_CHUNK_BYTES,
    OK,
    REPLY,
    REPLY_MAGIC,
    REQUEST_BYTES,
    REQUEST_MAGIC,
    REQUEST_TAG,
    UNKNOWN_TAG,
    _bounded,
    _context,
    _describe,
    _drop_frames,
    _pipeline,
    _tag,
    _ucx_error,
    _ucx_errors,
)

log = logging.getLogger(__name__)


class UcxWeightServer:
    """The trainer's UCX listener: holds each run's newest streams and serves them on request.

    ``host`` is the address replicas connect to, written into each location; the listener
    accepts on every interface. ``port`` 0 takes a free one (see :attr:`port` after
    :meth:`start`).
    """

    name = "ucx"
    in_memory = True

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

    async def send(
        self,
        run_id: str,
        step: int,
        stream: EncodedStream,
        adapter_config: Any = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> str:
        """Hold ``stream`` under ``<run_id>/step_<n>``; the location replicas fetch it from."""
        await self.start()
        tag = weights_object_key(run_id, step)
        versions = self._streams.setdefault(run_id, OrderedDict())
        versions.pop(step, None)
        versions[step] = stream
        while len(versions) > self.keep_last:
            versions.popitem(last=False)
        return f"ucx://{self.host}:{self.port}/{tag}"

    async def stored(self, run_id: str, *, tenant: str = DEFAULT_TENANT) -> set[int]:
        return set()  # this server holds only what it was given since it started

    async def forget(
        self, run_id: str, steps: Collection[int], *, tenant: str = DEFAULT_TENANT
    ) -> set[int]:
        versions = self._streams.get(run_id)
        if versions is not None:
            for step in steps:
                versions.pop(step, None)
            if not versions:
                del self._streams[run_id]
        return set(steps)

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
            await self._reply(ep, request_id, OK, stream)
            await self._send_stream(ep, request_id, stream)
        except _ucx_errors() as exc:
            # The replica went away or stalled; it sees its own error. Aborting makes sure no
            # send of this request stays posted.
            log.info("ucx weight server: request %d failed: %s", request_id, _describe(exc))
            self._endpoints.discard(ep)
            ep.abort()
            _drop_frames(exc)

    async def _send_stream(self, ep: Any, request_id: int, stream: EncodedStream) -> None:
        """The header, then the data buckets, each on its own tag."""
        await _bounded(
            ep.send(memoryview(stream.header), tag=_tag(request_id, 1)), self.stall_timeout
        )
        pieces = bucket_pieces(stream.data_segments(), self.chunk_bytes, sending=True)
        await _pipeline(ep, "send", pieces, request_id, self.window, self.stall_timeout)

    async def _reply(
        self,
        ep: Any,
        request_id: int,
        status: int,
        stream: EncodedStream | None = None,
    ) -> None:
        header, size = (len(stream.header), stream.size) if stream is not None else (0, 0)
        frame = REPLY.pack(REPLY_MAGIC, status, 0, header, size, self.chunk_bytes)
        await _bounded(ep.send(memoryview(frame), tag=_tag(request_id, 0)), self.stall_timeout)
