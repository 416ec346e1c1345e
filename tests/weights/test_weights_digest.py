"""The announced digest: publishers announce BLAKE3, readers still accept SHA-256 from older
publishers, refuse an algorithm they cannot check before a byte lands, and catch corruption
under either."""

from __future__ import annotations

import hashlib
from pathlib import Path

import blake3
import msgspec
import pytest
import torch

from schemas.codec import decode
from schemas.events import LoraSpec, WeightsReady
from services.bus import Bus
from services.model.peft_io import ADAPTER_WEIGHTS
from services.weights import WeightPublisher, WeightsError, load_weights
from services.weights.blobs import get_blob, write_blob
from services.weights.digest import algorithm, digest_of, hasher, verify

# The official BLAKE3 test vectors (test_vectors/test_vectors.json of the BLAKE3 reference
# repository): the input of each length is the byte cycle 0, 1, ..., 250, 0, 1, ...; the hash is
# the first 32 bytes of the published extended output. Lengths around the 1024-byte chunk and
# the tree's merge points, where an implementation of the tree goes wrong.
BLAKE3_VECTORS = {
    0: "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262",
    1: "2d3adedff11b61f14c886e35afa036736dcd87a74d27b5c1510225d0f592e213",
    1023: "10108970eeda3eb932baac1428c7a2163b0e924c9a9e25b35bba72b28f70bd11",
    1024: "42214739f095a406f3fc83deb889744ac00df831c10daa55189b5d121c855af7",
    1025: "d00278ae47eb27b34faecf67b4fe263f82d5412916c1ffd97c8cb7fb814b8444",
    2049: "5f4d72f40d7a5f82b15ca2b2e44b1de3c2ef86c426c95c1af0b6879522563030",
    4097: "9b4052b38f1c5fc8b1f9ff7ac7b27cd242487b3d890d15c96a1c25b8aa0fb995",
    7169: "a003fc7a51754a9b3c7fae0367ab3d782dccf28855a03d435f8cfe74605e7817",
}


def _flip_last_byte(path: Path) -> bytes:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    return bytes(data)


@pytest.mark.parametrize("transport", ["object_store", "filesystem"])
async def test_publishers_announce_blake3_of_the_stored_bytes(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora: LoraSpec, transport
):
    event = await WeightPublisher(bus, tmp_path, transport).publish(run_id, 0, 1, adapter, lora)
    if transport == "object_store":
        stored = await get_blob(bus, event.location)
    else:
        stored = (Path(event.location) / ADAPTER_WEIGHTS).read_bytes()
    # BLAKE3 as a client in any language computes it, not only as digest_of does
    assert event.digest == "blake3:" + blake3.blake3(stored).hexdigest()
    assert (event.size_bytes, len(event.digest)) == (len(stored), len("blake3:") + 64)
    loaded = await load_weights(bus, event, tmp_path)
    assert all(torch.equal(loaded[k], adapter[k]) for k in adapter)


@pytest.mark.parametrize("transport", ["object_store", "filesystem"])
async def test_an_older_publishers_sha256_is_still_accepted_and_checked(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora: LoraSpec, transport
):
    event = await WeightPublisher(bus, tmp_path, transport).publish(run_id, 0, 1, adapter, lora)
    path = Path(event.location) / ADAPTER_WEIGHTS
    stored = (
        await get_blob(bus, event.location) if transport == "object_store" else path.read_bytes()
    )
    sha = "sha256:" + hashlib.sha256(stored).hexdigest()
    if transport == "object_store":
        await write_blob(bus, event.location, stored)  # as an older publisher wrote it
    # An old event on the wire still decodes.
    old = decode(msgspec.json.encode(msgspec.structs.replace(event, digest=sha)), WeightsReady)
    loaded = await load_weights(bus, old, tmp_path)
    assert all(torch.equal(loaded[k], adapter[k]) for k in adapter)
    if transport == "object_store":
        corrupted = bytearray(stored)
        corrupted[-1] ^= 0x01
        await write_blob(bus, event.location, bytes(corrupted))
        # The store's own SHA-256 tells before a byte is read.
        with pytest.raises(WeightsError, match="holds other bytes than expected: its digest is"):
            await load_weights(bus, old, tmp_path)
        return
    corrupted = bytearray(_flip_last_byte(path))
    tampered = "sha256:" + hashlib.sha256(corrupted).hexdigest()
    with pytest.raises(WeightsError, match=f"digest mismatch: announced {sha} but the") as err:
        await load_weights(bus, old, tmp_path)
    assert str(err.value).endswith(f"hash to {tampered}")


async def test_a_corrupted_file_fails_the_blake3_check(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora: LoraSpec
):
    event = await WeightPublisher(bus, tmp_path, "filesystem").publish(run_id, 0, 1, adapter, lora)
    corrupted = _flip_last_byte(Path(event.location) / ADAPTER_WEIGHTS)
    with pytest.raises(WeightsError) as err:
        await load_weights(bus, event, tmp_path)
    assert str(err.value) == (
        f"weights for {run_id} step 1: digest mismatch: announced {event.digest} but the "
        f"{len(corrupted)} received bytes hash to {digest_of([corrupted])}"
    )


async def test_an_unknown_algorithm_is_refused_before_anything_lands(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora: LoraSpec
):
    event = await WeightPublisher(bus, tmp_path, "filesystem").publish(run_id, 0, 1, adapter, lora)
    # An event that passed its schema cannot name md5, but a fetcher may be handed anything.
    forged = msgspec.structs.replace(event, digest="md5:" + "0" * 32)
    destination = {k: torch.zeros_like(t) for k, t in adapter.items()}
    with pytest.raises(
        WeightsError, match=r"names algorithm 'md5', which this build cannot"
    ) as err:
        await load_weights(bus, forged, tmp_path, destination=destination)
    assert "known: blake3, sha256" in str(err.value)
    assert err.value.touched is False
    assert all(not t.any() for t in destination.values())


def test_digests_name_their_algorithm_and_verify_compares_them():
    data = b"plexrl" * 1000
    assert digest_of([data[:7], data[7:]]) == digest_of([data])
    assert digest_of([data], "sha256") == "sha256:" + hashlib.sha256(data).hexdigest()
    assert algorithm("w", digest_of([data])) == "blake3"
    assert algorithm("w", digest_of([data], "sha256")) == "sha256"
    for bad in ("blake3:" + "A" * 64, "sha256:abc", "crc32:00000000", ""):
        with pytest.raises(WeightsError, match="cannot check"):
            algorithm("w", bad)
    long = "nocolon" + "x" * 100  # named by its first 16 characters, shown up to 80
    for bad, name in ((long, long[:16]), ("md5:ab:cd", "md5")):
        with pytest.raises(WeightsError) as err:
            algorithm("w", bad)
        assert str(err.value) == (
            f"w: digest {bad[:80]!r} names algorithm {name!r}, which this build cannot check "
            "(known: blake3, sha256, as '<algorithm>:<64 hex digits>'); upgrade this service or "
            "the publisher"
        )
    verify("w", digest_of([data]), digest_of([data]), len(data))
    with pytest.raises(WeightsError) as err:
        verify("w", digest_of([data]), digest_of([data[1:]]), len(data) - 1)
    assert err.value.touched is False
    with pytest.raises(WeightsError, match=r"^w: digest mismatch") as err:
        verify("w", digest_of([data]), digest_of([data[1:]]), len(data) - 1, touched=True)
    assert err.value.touched is True


@pytest.mark.parametrize("length", sorted(BLAKE3_VECTORS))
def test_the_announced_digest_is_blake3_by_its_published_test_vectors(length: int):
    data = bytes(i % 251 for i in range(length))
    expected = BLAKE3_VECTORS[length]
    assert digest_of([data]) == f"blake3:{expected}"
    # in pieces that cut across BLAKE3's 64-byte blocks and 1024-byte chunks, as bytes land
    pieces = [data[i : i + 700] for i in range(0, length, 700)]
    assert digest_of([memoryview(p) for p in pieces]) == f"blake3:{expected}"
    one_thread = hasher("blake3")
    for piece in pieces:
        one_thread.update(piece)
    assert one_thread.hexdigest() == expected
