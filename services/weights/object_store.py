"""Blobs in the JetStream object store ``plexrl-weights``, written and read at stream speed.

The layout is the standard NATS object store, so any client (nats CLI, Go, nats-py's own
``ObjectStore``) reads what this module writes and the other way round: the chunks of an object
are messages on ``$O.<bucket>.C.<nuid>`` in the stream ``OBJ_<bucket>``, and its description
(nuid, size, chunk count, ``SHA-256=`` digest) is the last message on ``$O.<bucket>.M.<b64 key>``.

Two things differ from nats-py's ``ObjectStore.put``/``get``, both for speed:

- ``get`` there concatenates ``bytes`` chunk by chunk, which is quadratic (about 7 MB/s on a
  50 MB object). Here chunks are copied into one preallocated buffer, in order, from an ordered
  consumer, and the count, size and digest are checked against the object's description.
- ``put`` there waits for each chunk's acknowledgement before sending the next, 128 KiB at a
  time. Here chunks are up to 1 MiB (never above the server's ``max_payload``) and up to
  :data:`PUBLISH_WINDOW` of them are in flight at once.

``delete_blob`` purges an object's description as well as its chunks instead of leaving a
tombstone, so a store that keeps only the last few adapters of each run stays bounded.
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
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

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
from services.model.peft_io import sha256_digest

BUCKET = OBJECT_STORE_WEIGHTS
STREAM = OBJ_STREAM_TEMPLATE.format(bucket=BUCKET)

CHUNK_SIZE = 1024 * 1024
"""Largest chunk written. 1 MiB was the fastest size measured against the embedded server (it
allows 8 MiB messages) and is the default ``max_payload`` of a stock nats-server."""

PUBLISH_WINDOW = 16
"""Chunks published but not yet acknowledged, at most. Enough to keep the server busy; it bounds
the bytes a slow server leaves queued in the client."""

STALL_CHECK = 1.0
"""Seconds without a chunk after which a reader checks that the object still exists as it was."""

ACK_TIMEOUT = 30.0
"""Seconds to wait for the acknowledgement of one chunk or of the object's description."""

_VALID_KEY = re.compile(r"^[-/_=.a-zA-Z0-9]+$")
_nuid = NUID()


@dataclass(frozen=True)
class _Bucket:
    store: ObjectStore
    direct: bool
    """Whether the stream answers direct gets (nats-py, Go and the nats CLI all enable it)."""


_buckets: weakref.WeakKeyDictionary[Bus, _Bucket] = weakref.WeakKeyDictionary()


class BlobError(RuntimeError):
    """An object could not be stored or read back intact; the message names the key and why."""


class BlobNotFoundError(BlobError):
    """No object under the key (never written, deleted, or garbage-collected)."""


class Blob(NamedTuple):
    """An object's bytes and ``sha256:<hex>`` of exactly those bytes, hashed while reading."""

    data: bytes
    digest: str


async def put_blob(bus: Bus, key: str, data: bytes) -> None:
    """Store ``data`` under ``key``, replacing (and purging) any previous object of that key."""
    await write_blob(bus, key, data, sha256_digest(data))


async def get_blob(
    bus: Bus, key: str, *, expected_size: int | None = None, timeout: float = 30.0
) -> bytes:
    """The bytes stored under ``key``, checked against the object's size and digest.

    ``expected_size`` is checked before anything is downloaded. ``timeout`` bounds the whole
    read. Raises :class:`BlobNotFoundError` for a missing key, :class:`BlobError` otherwise.
    """
    blob = await read_blob(bus, key, expected_size=expected_size, timeout=timeout)
    return blob.data


async def delete_blob(bus: Bus, key: str) -> None:
    """Remove ``key`` and its chunks from the store; a key that is not there is left alone."""
    store = (await _bucket(bus)).store
    try:
        info = await store.get_info(_valid_key(key), show_deleted=True)
    except ObjectNotFoundError:
        return
    # The description goes first: a reader that looks the key up afterwards is told it is
    # missing, rather than finding a description whose chunks are gone.
    await bus.js.purge_stream(STREAM, subject=_meta_subject(key))
    if info.nuid:
        await bus.js.purge_stream(STREAM, subject=_chunk_subject(info.nuid))


async def list_keys(bus: Bus, timeout: float = 30.0) -> list[str]:
    """Every key in the store (deleted ones excluded)."""
    store = (await _bucket(bus)).store
    try:
        infos = await asyncio.wait_for(store.list(ignore_deletes=True), timeout)
    except NotFoundError:  # nats-py's answer for an empty store
        return []
    return [info.name for info in infos if not info.deleted]


async def write_blob(bus: Bus, key: str, data: bytes, digest: str) -> None:
    """:func:`put_blob` for a caller that already holds ``digest`` = ``sha256_digest(data)``.

    The publisher hashes an adapter for its WeightsReady event anyway; passing the digest in
    saves hashing the same bytes twice.
    """
    store = (await _bucket(bus)).store
    _valid_key(key)
    try:
        previous: api.ObjectInfo | None = await store.get_info(key)
    except ObjectNotFoundError:
        previous = None
    max_payload = bus.nc.max_payload or CHUNK_SIZE
    chunk_size = max(1, min(CHUNK_SIZE, max_payload))
    nuid = _nuid.next().decode()
    chunk_subject = _chunk_subject(nuid)
    view = memoryview(data)
    num_chunks = (len(data) + chunk_size - 1) // chunk_size
    in_flight: deque[asyncio.Future[api.PubAck]] = deque()
    try:
        for i in range(num_chunks):
            if len(in_flight) >= PUBLISH_WINDOW:
                await asyncio.wait_for(in_flight.popleft(), ACK_TIMEOUT)
            chunk = bytes(view[i * chunk_size : (i + 1) * chunk_size])
            in_flight.append(await bus.js.publish_async(chunk_subject, chunk))
        while in_flight:
            await asyncio.wait_for(in_flight.popleft(), ACK_TIMEOUT)
        info = api.ObjectInfo(
            name=key,
            bucket=BUCKET,
            nuid=nuid,
            size=len(data),
            chunks=num_chunks,
            mtime=datetime.now(UTC).isoformat(),
            digest=OBJ_DIGEST_TYPE + _b64_digest(digest),
            options=api.ObjectMetaOptions(max_chunk_size=chunk_size),
        )
        # The rollup header makes the server keep only this description of the key.
        await bus.js.publish(
            _meta_subject(key),
            json.dumps(info.as_dict()).encode(),
            timeout=ACK_TIMEOUT,
            headers={api.Header.ROLLUP: MSG_ROLLUP_SUBJECT},
        )
    except (TimeoutError, nats.errors.Error) as exc:
        for fut in in_flight:
            fut.cancel()
        # Chunks that no description points to would never be read or deleted. Removing them
        # is best effort: when the server is gone this fails too, and the error that matters
        # is the one below.
        with contextlib.suppress(TimeoutError, nats.errors.Error):
            await bus.js.purge_stream(STREAM, subject=chunk_subject)
        raise BlobError(
            f"could not store {key!r} ({len(data)} bytes) in object store {BUCKET!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if previous is not None and previous.nuid and not previous.deleted:
        await bus.js.purge_stream(STREAM, subject=_chunk_subject(previous.nuid))


async def read_blob(
    bus: Bus, key: str, *, expected_size: int | None = None, timeout: float = 30.0
) -> Blob:
    """:func:`get_blob`, also returning ``sha256:<hex>`` of the bytes (computed while reading)."""
    bucket = await _bucket(bus)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    info = await _info(bucket.store, key)
    for attempt in (1, 2):
        if expected_size is not None and info.size != expected_size:
            raise BlobError(
                f"object {key!r} holds {info.size} bytes, {expected_size} were expected"
            )
        got = await _read_object(bus, bucket, key, info, deadline)
        if got is not None:
            return got
        # The chunks stopped coming: the key may have been deleted (BlobNotFoundError here) or
        # overwritten (a new nuid) while it was read. Follow an overwrite once.
        current = await _info(bucket.store, key)
        if current.nuid == info.nuid or attempt == 2:
            break
        info = current
    raise BlobError(
        f"object {key!r}: not all of its {info.chunks} chunks ({info.size} bytes) arrived "
        f"within {timeout:g}s"
    )


async def _read_object(
    bus: Bus, bucket: _Bucket, key: str, info: api.ObjectInfo, deadline: float
) -> Blob | None:
    """The object described by ``info``, or None when its chunks stop coming before the
    deadline (or vanish). Any other inconsistency raises :class:`BlobError`."""
    size, num_chunks = info.size or 0, info.chunks or 0
    hasher = hashlib.sha256()
    if num_chunks == 1 and bucket.direct:
        # One chunk (every adapter up to 1 MiB): a direct get is one request, no consumer.
        try:
            msg = await bus.js.get_last_msg(STREAM, _chunk_subject(info.nuid), direct=True)
        except (NotFoundError, nats.errors.TimeoutError):
            return None
        data = msg.data or b""
        hasher.update(data)
    else:
        buffer = bytearray(size)
        if not await _stream_chunks(
            bus, bucket.store, key, info, deadline, memoryview(buffer), hasher
        ):
            return None
        data = bytes(buffer)
    if len(data) != size:
        raise BlobError(
            f"object {key!r}: {num_chunks} chunks hold {len(data)} bytes, its description "
            f"says {size}"
        )
    if info.digest and hasher.digest() != _raw_digest(info.digest):
        raise BlobError(
            f"object {key!r}: the {size} bytes read back do not match the object's SHA-256 "
            f"digest {info.digest} (the store is corrupt or the object changed while read)"
        )
    return Blob(data, "sha256:" + hasher.hexdigest())


async def _stream_chunks(
    bus: Bus,
    store: ObjectStore,
    key: str,
    info: api.ObjectInfo,
    deadline: float,
    view: memoryview,
    hasher: hashlib._Hash,
) -> bool:
    """Copy every chunk into ``view`` in order; False when they stop before the deadline."""
    num_chunks = info.chunks or 0
    if not num_chunks:
        return True
    loop = asyncio.get_running_loop()
    offset = received = 0
    # An ordered consumer is ephemeral, unacknowledged and flow-controlled: the server streams
    # the chunks as fast as this client takes them and resends from the last one after a gap.
    sub = await bus.js.subscribe(_chunk_subject(info.nuid), stream=STREAM, ordered_consumer=True)
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
                if not await _is_current(store, key, info.nuid):
                    return False
                continue
            chunk = msg.data
            if offset + len(chunk) > len(view):
                raise BlobError(
                    f"object {key!r}: chunk {received + 1} of {num_chunks} overruns its "
                    f"described size of {len(view)} bytes"
                )
            view[offset : offset + len(chunk)] = chunk
            # Hashing chunk by chunk overlaps with the server sending the next ones.
            hasher.update(chunk)
            offset += len(chunk)
            received += 1
    finally:
        await sub.unsubscribe()
    if offset != len(view):
        raise BlobError(
            f"object {key!r}: {num_chunks} chunks hold {offset} bytes, its description says "
            f"{len(view)}"
        )
    return True


async def _bucket(bus: Bus) -> _Bucket:
    """The bucket's handle, created on first use; looked up once per connection."""
    bucket = _buckets.get(bus)
    if bucket is None:
        try:
            store = await bus.js.object_store(BUCKET)
        except (BucketNotFoundError, NotFoundError):
            # nats-py 2.x: passing a config that names the bucket fails; the name alone works.
            store = await bus.js.create_object_store(BUCKET)
        stream = await bus.js.stream_info(STREAM)
        bucket = _Bucket(store, bool(stream.config.allow_direct))
        _buckets[bus] = bucket
    return bucket


async def _is_current(store: ObjectStore, key: str, nuid: str) -> bool:
    try:
        return (await store.get_info(key)).nuid == nuid
    except ObjectNotFoundError:
        return False


async def _info(store: ObjectStore, key: str) -> api.ObjectInfo:
    try:
        info = await store.get_info(_valid_key(key))
    except ObjectNotFoundError:
        raise BlobNotFoundError(
            f"object {key!r} is not in object store {BUCKET!r}: it was never written, or was "
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


def _chunk_subject(nuid: str) -> str:
    return OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=BUCKET, obj=nuid)


def _meta_subject(key: str) -> str:
    encoded = base64.urlsafe_b64encode(key.encode()).decode()
    return OBJ_META_PRE_TEMPLATE.format(bucket=BUCKET, obj=encoded)


def _b64_digest(digest: str) -> str:
    """``sha256:<hex>`` as the object store writes it: URL-safe base64 of the raw digest."""
    return base64.urlsafe_b64encode(bytes.fromhex(digest.removeprefix("sha256:"))).decode()


def _raw_digest(digest: str) -> bytes:
    """The 32 bytes of an object description's ``SHA-256=<base64>`` (padded or not)."""
    encoded = digest.split("=", 1)[1] if digest.upper().startswith("SHA-256=") else digest
    try:
        return base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
    except (binascii.Error, ValueError):
        return b""
