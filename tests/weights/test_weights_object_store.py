"""Blobs in ``plexrl-weights`` against a real nats-server: exact round trips at every size,
compatibility with nats-py's own object store, and clear errors for what cannot be read."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest
from nats.js import api
from nats.js.errors import NotFoundError

from services.bus import Bus
from services.weights import blobs as object_store
from services.weights import listing
from services.weights.blobs import (
    CHUNK_SIZE,
    STREAM,
    BlobError,
    BlobNotFoundError,
    _chunk_subject,
    delete_blob,
    get_blob,
    write_blob,
)
from services.weights.listing import list_keys


async def _info(bus: Bus, key: str) -> api.ObjectInfo:
    store = await bus.js.object_store("plexrl-weights")
    return await store.get_info(key)


async def _chunks_left(bus: Bus, nuid: str) -> bool:
    try:
        await bus.js.get_last_msg(STREAM, _chunk_subject(nuid))
    except NotFoundError:
        return False
    return True


@pytest.mark.parametrize("size", [0, 1, 1_000_000, 2 * CHUNK_SIZE, 50_000_000])
async def test_put_get_round_trip(bus: Bus, uid: str, size: int):
    key = f"t_{uid}/blob_{size}"
    data = os.urandom(size)
    await write_blob(bus, key, data)
    assert await get_blob(bus, key, expected_size=size) == data
    info = await _info(bus, key)
    assert info.size == size
    assert info.chunks == -(-size // CHUNK_SIZE)  # 1 MiB chunks, the last one partial


async def test_nats_py_object_store_reads_and_writes_the_same_objects(bus: Bus, uid: str):
    store = await bus.js.object_store("plexrl-weights")
    ours, theirs = os.urandom(3 * CHUNK_SIZE + 17), os.urandom(700_000)
    await write_blob(bus, f"t_{uid}/ours", ours)
    assert (await store.get(f"t_{uid}/ours")).data == ours
    # nats-py writes 128 KiB chunks: six of them here, streamed back in order.
    await store.put(f"t_{uid}/theirs", theirs)
    assert (await _info(bus, f"t_{uid}/theirs")).chunks == 6
    assert await get_blob(bus, f"t_{uid}/theirs") == theirs


async def test_get_of_a_missing_key_says_so(bus: Bus, uid: str):
    with pytest.raises(BlobNotFoundError) as err:
        await get_blob(bus, f"t_{uid}/never_written")
    assert f"'t_{uid}/never_written' is not in object store 'plexrl-weights'" in str(err.value)


async def test_expected_size_is_checked_before_reading(bus: Bus, uid: str):
    key = f"t_{uid}/sized"
    await write_blob(bus, key, b"x" * 100)
    with pytest.raises(BlobError, match=f"'{key}' holds 100 bytes, 99 were expected"):
        await get_blob(bus, key, expected_size=99)


async def test_overwrite_replaces_the_object_and_purges_the_old_chunks(bus: Bus, uid: str):
    key = f"t_{uid}/twice"
    await write_blob(bus, key, b"first" * 1000)
    old = await _info(bus, key)
    await write_blob(bus, key, b"second")
    assert await get_blob(bus, key) == b"second"
    assert not await _chunks_left(bus, old.nuid)


async def test_delete_removes_description_and_chunks_and_tolerates_missing_keys(bus: Bus, uid: str):
    key = f"t_{uid}/doomed"
    await write_blob(bus, key, os.urandom(CHUNK_SIZE + 1))
    nuid = (await _info(bus, key)).nuid
    assert key in await list_keys(bus)
    await delete_blob(bus, key)
    with pytest.raises(BlobNotFoundError):
        await get_blob(bus, key)
    assert not await _chunks_left(bus, nuid)
    assert key not in await list_keys(bus)
    await delete_blob(bus, key)  # a second delete is a no-op, not an error


async def test_missing_chunks_time_out_with_a_clear_error(bus: Bus, uid: str):
    key = f"t_{uid}/chunkless"
    await write_blob(bus, key, os.urandom(2 * CHUNK_SIZE))
    info = await _info(bus, key)
    await bus.js.purge_stream(STREAM, subject=_chunk_subject(info.nuid))
    with pytest.raises(BlobError, match=r"not all of its 2 chunks \(2097152 bytes\) arrived"):
        await get_blob(bus, key, timeout=0.5)


async def test_illegal_keys_are_rejected(bus: Bus):
    with pytest.raises(ValueError, match="illegal object key"):
        await write_blob(bus, "has space", b"x")


async def _stalled(bus: Bus, key: str) -> None:
    """An object whose description is there but whose chunks are not (yet) in the stream."""
    await write_blob(bus, key, os.urandom(2 * CHUNK_SIZE))
    info = await _info(bus, key)
    await bus.js.purge_stream(STREAM, subject=_chunk_subject(info.nuid))


async def test_a_reader_learns_quickly_that_its_object_was_deleted(
    bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch
):
    """The reader checks at each pause that its object still exists, and the first check after
    the deletion ends the read: it does not wait out its timeout."""
    checks: list[bool] = []
    is_current = object_store._is_current

    async def counted(*args):
        checks.append(await is_current(*args))
        return checks[-1]

    monkeypatch.setattr(object_store, "_is_current", counted)
    monkeypatch.setattr(object_store, "STALL_CHECK", 0.1)
    key = f"t_{uid}/collected"
    await _stalled(bus, key)
    # a timeout no test waits out: only a check can end this read
    reading = asyncio.create_task(get_blob(bus, key, timeout=3600.0))
    while not checks:  # the reader is waiting for chunks and has found its object there
        await asyncio.sleep(0.02)
    await delete_blob(bus, key)
    with pytest.raises(BlobNotFoundError, match="garbage-collected"):
        await asyncio.wait_for(reading, 60.0)  # bounds a hang only
    # every check before the deletion found the object; the first one after it ended the read
    assert checks[0] and checks.index(False) == len(checks) - 1


async def test_pieces_are_stored_as_one_object_and_streamed_back_chunk_by_chunk(bus: Bus, uid: str):
    key = f"t_{uid}/pieces"
    pieces = [os.urandom(n) for n in (3, CHUNK_SIZE - 1, 0, 2 * CHUNK_SIZE + 5, 7)]
    data = b"".join(pieces)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    await write_blob(bus, key, [memoryview(p) for p in pieces], digest)
    info = await _info(bus, key)
    assert (info.size, info.chunks) == (len(data), 4)  # cut across the pieces' boundaries
    assert await get_blob(bus, key) == data  # the stored digest is the one passed in
    chunks: list[bytes] = []
    await object_store.stream_blob(
        bus, key, chunks.append, expected_size=len(data), expected_digest=digest
    )
    assert [len(c) for c in chunks] == [CHUNK_SIZE] * 3 + [14]
    assert b"".join(chunks) == data
    chunks.clear()
    with pytest.raises(BlobError, match=f"'{key}' holds other bytes than expected"):
        await object_store.stream_blob(
            bus, key, chunks.append, expected_digest="sha256:" + "0" * 64
        )
    assert chunks == []


async def test_a_listing_from_a_replica_behind_the_leader_is_read_again(
    bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a cluster the listing's consumer may sit on a replica still catching up after a
    restart. Its first reading here is what such a replica gives (the newest description not
    there yet: the store before the last write): the listing is read again until it reaches
    the leader's newest description, so it names the last object and not the deleted one."""
    old, new = f"{uid}/old", f"{uid}/new"
    await write_blob(bus, old, b"o")
    await write_blob(bus, new, b"n")
    await delete_blob(bus, old)
    real = listing._read_descriptions
    readings: list[int] = []

    async def lagging_first(bus: Bus, bucket: str) -> tuple[list[str], int]:
        keys, seen = await real(bus, bucket)
        readings.append(seen)
        if len(readings) == 1:  # the replica has neither the deletion nor the last write
            return [k for k in keys if k != new] + [old], seen - 2
        return keys, seen

    monkeypatch.setattr(listing, "_read_descriptions", lagging_first)
    keys = await list_keys(bus)
    assert new in keys and old not in keys
    assert len(readings) == 2
