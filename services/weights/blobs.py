"""Blobs in the JetStream object store ``plexrl-weights``, written and read at stream speed.

The layout is the standard NATS object store, so any client (nats CLI, Go, nats-py's own
``ObjectStore``) reads what this module writes and the other way round: the chunks of an object
are messages on ``$O.<bucket>.C.<nuid>`` in the stream ``OBJ_<bucket>``, and its description
(nuid, size, chunk count, ``SHA-256=`` digest) is the last message on ``$O.<bucket>.M.<b64 key>``.
The SHA-256 digest is the store's own (every client checks it); the digest a WeightsReady
announces (BLAKE3) is recorded beside it, in the description's header :data:`DIGEST_HEADER`.

Three things differ from nats-py's ``ObjectStore.put``/``get``, for speed and for memory:

- ``get`` there concatenates ``bytes`` chunk by chunk, which is quadratic (about 7 MB/s on a
  50 MB object). Here chunks come in order from an ordered consumer and are joined once, and
  their count and size are checked against the object's description.
- :func:`stream_blob` reads an object without holding it at all: each chunk goes to the
  caller as it arrives (full weights land straight in a model's parameters, see
  :meth:`services.weights.stream.StreamDecoder.feed`), so a model is never in memory twice.
- ``put`` there waits for each chunk's acknowledgement before sending the next, 128 KiB at a
  time. Here chunks are up to 1 MiB (never above the server's ``max_payload``) and up to
  :data:`PUBLISH_WINDOW` of them are in flight at once (their acknowledgements read by
  :class:`~services.bus.pipeline.AckPipeline`, so a refusal is an error at once rather than a
  timeout); :func:`write_blob` also takes the object as a sequence of pieces (a state dict's
  tensors, viewed as bytes), cut into chunks as they go, so no copy of the whole object is made.

``delete_blob`` purges an object's description as well as its chunks instead of leaving a
tombstone, so a store that keeps only the last few adapters of each run stays bounded.

Every function takes the store's name (``bucket``, default ``plexrl-weights``): a tenant's
adapters live in a store of its own (:func:`schemas.subjects.weights_bucket`), created on first
use with the process settings' ``stream_replicas`` and ``tenant_weights_store_max_bytes``. A
store that is full refuses the whole object: the chunks that landed are purged and
:func:`write_blob` raises :class:`~services.bus.errors.StorageFull`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import re
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import nats.errors
from nats.js import api
from nats.js.errors import BucketNotFoundError, NotFoundError, ObjectNotFoundError
from nats.js.kv import MSG_ROLLUP_SUBJECT
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)
from nats.nuid import NUID

from schemas.subjects import OBJECT_STORE_WEIGHTS
from services.bus import Bus
from services.bus.limits import storage_full
from services.bus.pipeline import AckPipeline
from services.config import process_settings

BUCKET = OBJECT_STORE_WEIGHTS
STREAM = OBJ_STREAM_TEMPLATE.format(bucket=BUCKET)
"""The stream of the default store (each store ``b`` has its stream ``OBJ_<b>``)."""

CHUNK_SIZE = 1024 * 1024
"""Largest chunk written. 1 MiB was the fastest size measured against the embedded server (it
allows 8 MiB messages) and is the default ``max_payload`` of a stock nats-server."""

PUBLISH_WINDOW = 16
"""Chunks published but not yet acknowledged, at most. Enough to keep the server busy; it bounds
the bytes a slow server leaves queued in the client."""

STALL_CHECK = 1.0
"""Seconds without a chunk after which a reader checks that the object still exists as it was."""

DIGEST_HEADER = "Plexrl-Digest"
"""The description's header that records the digest the weights were announced with."""

ACK_TIMEOUT = 30.0
"""Seconds to wait for the acknowledgement of one chunk or of the object's description."""

_VALID_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")
_nuid = NUID()


@dataclass(frozen=True)
class _Bucket:
    name: str
    store: ObjectStore
    direct: bool
    """Whether the stream answers direct gets (nats-py, Go and the nats CLI all enable it)."""

    @property
    def stream(self) -> str:
        return _stream(self.name)


_buckets: weakref.WeakKeyDictionary[Bus, dict[str, _Bucket]] = weakref.WeakKeyDictionary()


class BlobError(RuntimeError):
    """An object could not be stored or read back intact; the message names the key and why."""


class BlobNotFoundError(BlobError):
    """No object under the key (never written, deleted, or garbage-collected)."""


Pieces = bytes | bytearray | memoryview | Iterable[bytes | bytearray | memoryview]
"""An object's bytes: in one buffer, or as buffers that follow each other."""

Sink = Callable[[bytes], None]
"""Takes an object's chunks in order, as :func:`stream_blob` reads them."""


async def delete_blob(bus: Bus, key: str, *, bucket: str = BUCKET) -> None:
    """Remove ``key`` and its chunks from the store; a key that is not there is left alone."""
    store = (await _bucket(bus, bucket)).store
    try:
        info = await store.get_info(_valid_key(key), show_deleted=True)
    except ObjectNotFoundError:
        return
    # The description goes first: a reader that looks the key up afterwards is told it is
    # missing, rather than finding a description whose chunks are gone.
    await bus.js.purge_stream(_stream(bucket), subject=_meta_subject(key, bucket))
    if info.nuid:
        await bus.js.purge_stream(_stream(bucket), subject=_chunk_subject(info.nuid, bucket))


async def write_blob(
    bus: Bus, key: str, data: Pieces, announced: str | None = None, *, bucket: str = BUCKET
) -> None:
    """Store ``data`` under ``key``, replacing (and purging) any previous object of that key.

    ``data`` is one buffer, or buffers that follow each other (:meth:`EncodedStream.segments
    <services.weights.stream.EncodedStream.segments>`), cut into chunks across their
    boundaries, so only one chunk at a time is copied.

    The store's SHA-256 digest is computed on another thread while the chunks are published.
    ``announced``, the digest a WeightsReady gives these bytes, is recorded in the description
    (:data:`DIGEST_HEADER`), so a reader can tell before reading whether the object is the one
    announced (:func:`stream_blob`).
    """
    store = (await _bucket(bus, bucket)).store
    _valid_key(key)
    try:
        previous: api.ObjectInfo | None = await store.get_info(key)
    except ObjectNotFoundError:
        previous = None
    max_payload = bus.nc.max_payload or CHUNK_SIZE
    chunk_size = max(1, min(CHUNK_SIZE, max_payload))
    nuid = _nuid.next().decode()
    chunk_subject = _chunk_subject(nuid, bucket)
    pieces = [data] if isinstance(data, bytes | bytearray | memoryview) else list(data)
    hashing = asyncio.ensure_future(asyncio.to_thread(_sha256, pieces))
    size = num_chunks = 0
    in_flight: deque[asyncio.Future[api.PubAck]] = deque()
    try:
        async with AckPipeline(bus.nc) as pipeline:
            for chunk in _rechunk(pieces, chunk_size):
                if len(in_flight) >= PUBLISH_WINDOW:
                    await asyncio.wait_for(in_flight.popleft(), ACK_TIMEOUT)
                in_flight.append(await pipeline.publish(chunk_subject, chunk))
                size += len(chunk)
                num_chunks += 1
            while in_flight:
                await asyncio.wait_for(in_flight.popleft(), ACK_TIMEOUT)
        digest = await hashing
        info = api.ObjectInfo(
            name=key,
            bucket=bucket,
            nuid=nuid,
            size=size,
            chunks=num_chunks,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TYPE + base64.urlsafe_b64encode(digest).decode(),
            # Go's client reads headers as lists of strings.
            headers={DIGEST_HEADER: [announced]} if announced else None,
            options=api.ObjectMetaOptions(max_chunk_size=chunk_size),
        )
        # The rollup header makes the server keep only this description of the key.
        await bus.js.publish(
            _meta_subject(key, bucket),
            json.dumps(info.as_dict()).encode(),
            timeout=ACK_TIMEOUT,
            headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT},
        )
    except (TimeoutError, nats.errors.Error) as exc:
        for fut in in_flight:
            fut.cancel()
        await asyncio.gather(hashing, return_exceptions=True)
        # Chunks that no description points to would never be read or deleted. Removing them
        # is best effort: when the server is gone this fails too, and the error that matters
        # is the one below.
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            await bus.js.purge_stream(_stream(bucket), subject=chunk_subject)
        full = storage_full(
            exc,
            where=f"object store {bucket}",
            setting=_size_setting(bucket),
            what=f"object {key!r} ({sum(memoryview(p).nbytes for p in pieces)} bytes)",
        )
        if full is not None:
            raise full from exc
        raise BlobError(
            f"could not store {key!r} in object store {bucket!r} (failed after {size} bytes): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if previous is not None and previous.nuid and not previous.deleted:
        await bus.js.purge_stream(_stream(bucket), subject=_chunk_subject(previous.nuid, bucket))


async def get_blob(
    bus: Bus,
    key: str,
    *,
    expected_size: int | None = None,
    timeout: float = 30.0,
    bucket: str = BUCKET,
) -> bytes:
    """The bytes stored under ``key``, in one buffer: :func:`stream_blob` into a list, joined."""
    chunks: list[bytes] = []
    await stream_blob(
        bus, key, chunks.append, expected_size=expected_size, timeout=timeout, bucket=bucket
    )
    return b"".join(chunks)


async def stream_blob(
    bus: Bus,
    key: str,
    sink: Sink,
    *,
    expected_size: int | None = None,
    expected_digest: str | None = None,
    timeout: float = 30.0,
    bucket: str = BUCKET,
) -> None:
    """Hand the chunks stored under ``key`` to ``sink``, in order, without keeping them.

    ``expected_size`` and ``expected_digest`` (as announced) are checked against the object's
    description before the first chunk is read (the digest against the one recorded at
    :func:`write_blob`, or a ``sha256:`` one against the store's own), so an object replaced
    by other bytes is refused before anything reaches ``sink``. The bytes themselves are not
    hashed here: the sink checks what it received (:meth:`StreamDecoder.finish
    <services.weights.stream.StreamDecoder.finish>`). Whatever ``sink`` raises ends the read and propagates. :class:`BlobNotFoundError`
    for a missing key (or one deleted while it was read), :class:`BlobError` for the rest: an
    object overwritten while read is not followed, since part of it reached ``sink`` already.
    """
    handle = await _bucket(bus, bucket)
    deadline = asyncio.get_running_loop().time() + timeout
    info = await _info(handle, key)
    _check_expected(key, info, expected_size, expected_digest)
    if await _read_object(bus, handle, key, info, deadline, sink):
        return
    if (await _info(handle, key)).nuid != info.nuid:
        raise BlobError(f"object {key!r} was replaced while it was read")
    raise BlobError(
        f"object {key!r}: not all of its {info.chunks} chunks ({info.size} bytes) arrived "
        f"within {timeout:g}s"
    )


def _check_expected(key: str, info: api.ObjectInfo, size: int | None, digest: str | None) -> None:
    if size is not None and info.size != size:
        raise BlobError(f"object {key!r} holds {info.size} bytes, {size} were expected")
    if digest is None:
        return
    recorded = (info.headers or {}).get(DIGEST_HEADER)
    if isinstance(recorded, list):
        recorded = recorded[0] if recorded else None
    if recorded is None and digest.startswith("sha256:") and info.digest:
        recorded = "sha256:" + _raw_digest(info.digest).hex()
    if recorded is not None and recorded != digest:
        raise BlobError(
            f"object {key!r} holds other bytes than expected: its digest is {recorded}, "
            f"{digest} was expected (digest mismatch; overwritten since?)"
        )


async def _read_object(
    bus: Bus, bucket: _Bucket, key: str, info: api.ObjectInfo, deadline: float, sink: Sink
) -> bool:
    """Hand each chunk of the object ``info`` describes to ``sink``, in order; False when they
    stop coming before the deadline (or vanish). A chunk count or size other than the
    description's raises :class:`BlobError`."""
    size, num_chunks = info.size or 0, info.chunks or 0
    if num_chunks == 1 and bucket.direct:
        # One chunk (every adapter up to 1 MiB): a direct get is one request, no consumer.
        try:
            raw = await bus.js.get_last_msg(
                bucket.stream, _chunk_subject(info.nuid, bucket.name), direct=True
            )
        except (NotFoundError, nats.errors.TimeoutError):
            return False
        data = raw.data or b""
        if len(data) != size:
            raise BlobError(
                f"object {key!r}: {num_chunks} chunks hold {len(data)} bytes, its description "
                f"says {size}"
            )
        sink(data)
        return True
    if not num_chunks:
        if size:
            raise BlobError(f"object {key!r}: no chunks hold its described {size} bytes")
        return True
    loop = asyncio.get_running_loop()
    offset = received = 0
    # An ordered consumer is ephemeral, unacknowledged and flow-controlled: the server streams
    # the chunks as fast as this client takes them and resends from the last one after a gap.
    sub = await bus.js.subscribe(
        _chunk_subject(info.nuid, bucket.name), stream=bucket.stream, ordered_consumer=True
    )
    try:
        while received < num_chunks:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                msg = await sub.next_msg(timeout=min(remaining, STALL_CHECK))
            except nats.errors.TimeoutError:
                # A pause: stop early when the object was replaced or deleted meanwhile (old
                # versions are garbage-collected) instead of waiting out the whole timeout.
                if not await _is_current(bucket.store, key, info.nuid):
                    return False
                continue
            chunk = msg.data
            if offset + len(chunk) > size:
                raise BlobError(
                    f"object {key!r}: chunk {received + 1} of {num_chunks} overruns its "
                    f"described size of {size} bytes"
                )
            sink(chunk)
            offset += len(chunk)
            received += 1
    finally:
        await sub.unsubscribe()
    if offset != size:
        raise BlobError(
            f"object {key!r}: {num_chunks} chunks hold {offset} bytes, its description says {size}"
        )
    return True


def _rechunk(pieces: Iterable[bytes | bytearray | memoryview], chunk_size: int) -> Iterator[bytes]:
    """The bytes of ``pieces``, one after the other, in chunks of ``chunk_size`` (the last one
    shorter); a chunk may span pieces. Each chunk is the only copy made."""
    pending = bytearray()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if pending:
            take = min(chunk_size - len(pending), len(view))
            pending += view[:take]
            view = view[take:]
            if len(pending) < chunk_size:
                continue
            yield bytes(pending)
            pending = bytearray()
        whole = len(view) - len(view) % chunk_size
        for start in range(0, whole, chunk_size):
            yield bytes(view[start : start + chunk_size])
        pending += view[whole:]
    if pending:
        yield bytes(pending)


async def _bucket(bus: Bus, name: str = BUCKET) -> _Bucket:
    """The bucket's handle, created on first use; looked up once per connection."""
    known = _buckets.setdefault(bus, {})
    bucket = known.get(name)
    if bucket is None:
        try:
            store = await bus.js.object_store(name)
        except (BucketNotFoundError, NotFoundError):
            # nats-py 2.x: passing a config that names the bucket fails; the name alone works.
            settings = process_settings()
            limit = (
                settings.weights_store_max_bytes
                if name == BUCKET
                else settings.tenant_weights_store_max_bytes
            )
            store = await bus.js.create_object_store(
                name, replicas=settings.stream_replicas, max_bytes=int(limit) or -1
            )
        stream = await bus.js.stream_info(_stream(name))
        bucket = _Bucket(name, store, bool(stream.config.allow_direct))
        known[name] = bucket
    return bucket


async def _is_current(store: ObjectStore, key: str, nuid: str) -> bool:
    try:
        return (await store.get_info(key)).nuid == nuid
    except ObjectNotFoundError:
        return False


async def _info(bucket: _Bucket, key: str) -> api.ObjectInfo:
    try:
        info = await bucket.store.get_info(_valid_key(key))
    except ObjectNotFoundError:
        raise BlobNotFoundError(
            f"object {key!r} is not in object store {bucket.name!r}: it was never written, or was "
            "deleted (older adapters are garbage-collected as new ones are published)"
        ) from None
    if not info.nuid:
        raise BlobError(f"object {key!r}: its description names no chunks (nuid is empty)")
    return info


def _valid_key(key: str) -> str:
    if not isinstance(key, str) or _VALID_KEY.fullmatch(key) is None:
        raise ValueError(
            f"illegal object key {key!r}: use letters, digits and '-', '/', '_', '=', '.'"
        )
    return key


def _size_setting(bucket: str) -> str:
    """The process setting of ``bucket``'s byte limit."""
    return "weights_store_max_bytes" if bucket == BUCKET else "tenant_weights_store_max_bytes"


def _stream(bucket: str) -> str:
    return OBJ_STREAM_TEMPLATE.format(bucket=bucket)


def _chunk_subject(nuid: str, bucket: str = BUCKET) -> str:
    return OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj=nuid)


def _meta_subject(key: str, bucket: str = BUCKET) -> str:
    encoded = base64.urlsafe_b64encode(key.encode()).decode()
    return OBJ_META_PRE_TEMPLATE.format(bucket=bucket, obj=encoded)


def _sha256(pieces: list[bytes | bytearray | memoryview]) -> bytes:
    hasher = hashlib.sha256()
    for piece in pieces:
        hasher.update(piece)
    return hasher.digest()


def _raw_digest(digest: str) -> bytes:
    """The 32 bytes of an object description's ``SHA-256=<base64>`` (padded or not)."""
    encoded = digest.split("=", 1)[1] if digest.upper().startswith("SHA-256=") else digest
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):
        return b""
