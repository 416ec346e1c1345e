"""A replica's end of the ``ucx`` transport: :class:`UcxWeightClient`, one per event loop."""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from schemas.events import WeightsReady
from schemas.tenant import DEFAULT_TENANT
from services.weights.buckets import bucket_pieces
from services.weights.errors import WeightsError
from services.weights.header import MAX_HEADER_BYTES
from services.weights.stream import StreamDecoder
from services.weights.ucx.wire import (
    _REQUEST_HEAD,
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
    _pipeline,
    _tag,
    _ucx_errors,
    parse_location,
)


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
        self,
        event: WeightsReady,
        destination: Mapping[str, Tensor] | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
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
        if _REQUEST_HEAD.size + len(encoded) > REQUEST_BYTES:
            raise WeightsError(f"{where}: tag {tag!r} is too long for a request")
        frame = bytearray(REQUEST_BYTES)
        _REQUEST_HEAD.pack_into(frame, 0, REQUEST_MAGIC, request_id, len(encoded))
        frame[_REQUEST_HEAD.size : _REQUEST_HEAD.size + len(encoded)] = encoded
        reply = bytearray(REPLY.size)
        try:
            await _bounded(ep.send(memoryview(frame), tag=REQUEST_TAG), self.stall_timeout)
            await _bounded(ep.recv(memoryview(reply), tag=_tag(request_id, 0)), self.stall_timeout)
        except _ucx_errors():
            if cached:
                raise _Stale() from None
            raise
        magic, status, _, header_len, size, chunk_bytes = REPLY.unpack(reply)
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
        pieces = bucket_pieces(decoder.targets(), chunk_bytes, sending=False, landed=decoder.landed)
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
