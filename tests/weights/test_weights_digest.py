"""The announced digest: publishers announce BLAKE3, readers still accept SHA-256 from older
publishers, refuse an algorithm they cannot check before a byte lands, and catch corruption
under either."""

from __future__ import annotations

import hashlib
from pathlib import Path

import msgspec
import pytest
import torch

from schemas.codec import decode
from schemas.events import LoraSpec, WeightsReady
from services.bus import Bus
from services.model.peft_io import ADAPTER_WEIGHTS
from services.weights import WeightPublisher, WeightsError, load_weights
from services.weights.blobs import get_blob, write_blob
from services.weights.digest import algorithm, digest_of, verify


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
    assert event.digest.startswith("blake3:")
    assert event.digest == digest_of([stored])
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
    verify("w", digest_of([data]), digest_of([data]), len(data))
    with pytest.raises(WeightsError, match=r"^w: digest mismatch") as err:
        verify("w", digest_of([data]), digest_of([data[1:]]), len(data) - 1, touched=True)
    assert err.value.touched is True
