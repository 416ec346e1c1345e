"""Trainer to inference: publish an adapter, announce it, load it back bit for bit, refuse it when
anything about it is wrong, and keep only the last few versions of each run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import msgspec
import pytest
import torch

from schemas.codec import decode
from schemas.events import LoraSpec, WeightsReady
from schemas.subjects import WEIGHTS_STREAM, weights_subject
from services.bus import Bus
from services.model.peft_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS, read_peft_dir
from services.weights import WeightPublisher, WeightsError, load_weights
from services.weights.blobs import BlobNotFoundError, get_blob, write_blob
from services.weights.digest import digest_of
from services.weights.listing import list_keys


def _assert_same(loaded: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> None:
    assert set(loaded) == set(sent)
    for key, tensor in sent.items():
        assert loaded[key].dtype == tensor.dtype
        assert torch.equal(loaded[key], tensor), key


async def test_object_store_round_trip(bus: Bus, tmp_path: Path, run_id: str, adapter, lora):
    publisher = WeightPublisher(bus, tmp_path)
    event = await publisher.publish(run_id, 7, 3, adapter, lora)
    assert (event.run_id, event.idx, event.step) == (run_id, 7, 3)
    assert (event.transport, event.location) == ("object_store", f"{run_id}/step_3")
    stored = await get_blob(bus, event.location)
    assert event.size_bytes == len(stored)
    assert event.digest == digest_of([stored])
    assert event.lora == lora
    _assert_same(await load_weights(bus, event), adapter)


async def test_filesystem_round_trip_writes_a_peft_directory(
    bus: Bus, tmp_path: Path, run_id: str, make_adapter, lora
):
    adapter = make_adapter(seed=1, dtype=torch.bfloat16)
    publisher = WeightPublisher(bus, tmp_path, transport="filesystem")
    event = await publisher.publish(run_id, 0, 5, adapter, lora, base_model_path="/models/tiny")
    directory = tmp_path / run_id / "broadcast" / "step_5"
    assert (event.transport, event.location) == ("filesystem", str(directory))
    weights = (directory / ADAPTER_WEIGHTS).read_bytes()
    assert event.digest == digest_of([weights])
    assert event.size_bytes == len(weights)
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert config["base_model_name_or_path"] == "/models/tiny"
    _, rank, alpha, modules = read_peft_dir(directory)
    assert (rank, alpha, sorted(modules)) == (4, 8.0, ["down_proj", "q_proj", "up_proj"])
    _assert_same(await load_weights(bus, event, output_dir=tmp_path), adapter)


async def test_weights_ready_is_on_the_weights_stream(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 2, 1, adapter, lora)
    raw = await bus.js.get_last_msg(WEIGHTS_STREAM, weights_subject(run_id))
    assert raw.subject == f"plexrl.weights.{run_id}"
    assert raw.headers is not None
    assert raw.headers["Nats-Msg-Id"] == f"{run_id}/weights/step_1/{event.digest[7:23]}"
    assert raw.data is not None
    assert decode(raw.data, WeightsReady, raw.headers.get("Content-Type")) == event


async def test_a_corrupted_object_fails_the_digest_check(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 4, adapter, lora)
    stored = bytearray(await get_blob(bus, event.location))
    stored[-1] ^= 0x01  # same size, one bit off: only the digest can tell
    await write_blob(bus, event.location, bytes(stored))
    with pytest.raises(WeightsError) as err:
        await load_weights(bus, event)
    message = str(err.value)
    assert message.startswith(f"weights for {run_id} step 4: digest mismatch: ")
    tampered = digest_of([stored])
    assert f"announced {event.digest} but the {len(stored)} received bytes hash to {tampered}" in (
        message
    )


async def test_an_object_of_the_wrong_size_is_refused_before_download(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 2, adapter, lora)
    await write_blob(bus, event.location, b"short")
    with pytest.raises(WeightsError, match=f"{run_id} step 2: .* holds 5 bytes, "):
        await load_weights(bus, event)


async def test_a_missing_object_names_run_and_step(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 1, adapter, lora)
    gone = msgspec.structs.replace(event, location=f"{run_id}/step_999")
    with pytest.raises(
        WeightsError, match=f"weights for {run_id} step 1: .*is not in object store"
    ):
        await load_weights(bus, gone)


async def test_a_truncated_file_is_refused(bus: Bus, tmp_path: Path, run_id: str, adapter, lora):
    event = await WeightPublisher(bus, tmp_path, transport="filesystem").publish(
        run_id, 0, 1, adapter, lora
    )
    weights = Path(event.location) / ADAPTER_WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError) as err:
        await load_weights(bus, event, output_dir=tmp_path)
    assert str(err.value).startswith(f"weights for {run_id} step 1: size mismatch: ")
    assert f"announced {len(data)} bytes" in str(err.value)


async def test_a_file_changed_in_place_fails_the_digest_check(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path, transport="filesystem").publish(
        run_id, 0, 1, adapter, lora
    )
    weights = Path(event.location) / ADAPTER_WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=f"{run_id} step 1: digest mismatch: announced"):
        await load_weights(bus, event)


async def test_a_location_outside_the_output_dir_is_refused(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    inside, outside = tmp_path / "out", tmp_path / "elsewhere"
    event = await WeightPublisher(bus, outside, transport="filesystem").publish(
        run_id, 0, 1, adapter, lora
    )
    with pytest.raises(WeightsError, match="is outside the output directory"):
        await load_weights(bus, event, output_dir=inside)
    # A path that starts inside and climbs out is outside too.
    inside.mkdir()
    climbing = msgspec.structs.replace(
        event, location=str(inside / ".." / "elsewhere" / run_id / "broadcast" / "step_1")
    )
    with pytest.raises(WeightsError, match="is outside the output directory"):
        await load_weights(bus, climbing, output_dir=inside)
    # So is a symlink inside that leads out.
    (inside / "link").symlink_to(outside / run_id / "broadcast" / "step_1")
    linked = msgspec.structs.replace(event, location=str(inside / "link"))
    with pytest.raises(WeightsError, match="is outside the output directory"):
        await load_weights(bus, linked, output_dir=inside)
    # The same event is fine where the directory is allowed.
    _assert_same(await load_weights(bus, event, output_dir=outside), adapter)


async def test_a_missing_directory_says_it_may_have_been_collected(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path, transport="filesystem").publish(
        run_id, 0, 1, adapter, lora
    )
    shutil.rmtree(event.location)
    with pytest.raises(WeightsError, match=f"{run_id} step 1: cannot read .*garbage-collected"):
        await load_weights(bus, event)


async def test_a_transport_without_a_fetcher_is_not_available(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 1, adapter, lora)
    other = msgspec.structs.replace(event, transport="collective")
    with pytest.raises(
        WeightsError,
        match=f"^weights for {run_id} step 1: transport 'collective' is not available in this "
        "process",
    ):
        await load_weights(bus, other)


async def test_a_ucx_event_whose_location_is_no_ucx_address_is_refused(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 1, adapter, lora)
    other = msgspec.structs.replace(event, transport="ucx")
    with pytest.raises(
        WeightsError,
        match=f"^weights for {run_id} step 1: location '{run_id}/step_1' is not a UCX address",
    ):
        await load_weights(bus, other)


async def test_an_adapter_of_another_rank_than_announced_is_refused(
    bus: Bus, tmp_path: Path, run_id: str, make_adapter
):
    rank_8 = LoraSpec(rank=8, alpha=16.0, target_modules=["q_proj"])
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 1, make_adapter(2), rank_8)
    with pytest.raises(WeightsError, match="is not a rank-8 LoRA matrix"):
        await load_weights(bus, event)


async def test_bytes_that_are_not_safetensors_are_refused(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    event = await WeightPublisher(bus, tmp_path).publish(run_id, 0, 1, adapter, lora)
    junk = os.urandom(64)
    await write_blob(bus, f"{run_id}/junk", junk)
    forged = msgspec.structs.replace(
        event,
        location=f"{run_id}/junk",
        size_bytes=64,
        digest="sha256:" + hashlib.sha256(junk).hexdigest(),  # an older publisher's
    )
    with pytest.raises(WeightsError, match="the data is not safetensors"):
        await load_weights(bus, forged)


async def test_object_store_keeps_only_the_last_versions(
    bus: Bus, tmp_path: Path, run_id: str, make_adapter, lora
):
    publisher = WeightPublisher(bus, tmp_path, keep_last=2)
    events = [await publisher.publish(run_id, 0, s, make_adapter(s), lora) for s in range(1, 6)]
    for event in events[:3]:
        with pytest.raises(BlobNotFoundError):
            await get_blob(bus, event.location)
    for step, event in zip((4, 5), events[3:], strict=True):
        _assert_same(await load_weights(bus, event), make_adapter(step))


async def test_filesystem_keeps_only_the_last_versions_and_never_the_current_one(
    bus: Bus, tmp_path: Path, run_id: str, make_adapter, lora
):
    broadcast = tmp_path / run_id / "broadcast"
    publisher = WeightPublisher(bus, tmp_path, transport="filesystem", keep_last=1)
    for step in (1, 2, 3):
        event = await publisher.publish(run_id, 0, step, make_adapter(step), lora)
        assert sorted(p.name for p in broadcast.iterdir()) == [f"step_{step}"]
        _assert_same(await load_weights(bus, event, output_dir=tmp_path), make_adapter(step))


@pytest.mark.parametrize("transport", ["object_store", "filesystem"])
async def test_a_restarted_publisher_collects_what_an_earlier_one_left(
    bus: Bus, tmp_path: Path, run_id: str, make_adapter, lora, transport
):
    first = WeightPublisher(bus, tmp_path, transport=transport, keep_last=10)
    for step in (1, 2, 3, 9):
        await first.publish(run_id, 0, step, make_adapter(step), lora)
    # Restarted from the checkpoint of step 3: step 4 is announced, 1 and 2 go, and 9 (from the
    # run's abandoned future) stays until step 9 is published again.
    second = WeightPublisher(bus, tmp_path, transport=transport, keep_last=2)
    await second.publish(run_id, 0, 4, make_adapter(4), lora)
    if transport == "filesystem":
        left = {
            int(p.name.removeprefix("step_")) for p in (tmp_path / run_id / "broadcast").iterdir()
        }
    else:
        left = {
            int(key.rsplit("_", 1)[1])
            for key in await list_keys(bus)
            if key.startswith(f"{run_id}/")
        }
    assert left == {3, 4, 9}


def test_publisher_rejects_settings_it_cannot_honour(tmp_path: Path):
    bus = object.__new__(Bus)  # never used: the constructor checks its arguments first
    with pytest.raises(ValueError, match="weight transport 'carrier_pigeon' is not known"):
        WeightPublisher(bus, tmp_path, transport="carrier_pigeon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        WeightPublisher(bus, tmp_path, keep_last=0)


async def test_what_no_consumer_would_accept_is_refused_before_anything_is_stored(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
):
    publisher = WeightPublisher(bus, tmp_path, transport="filesystem")
    with pytest.raises(ValueError, match=r"<= 4095 - at `\$.idx`"):
        await publisher.publish(run_id, 4096, 1, adapter, lora)
    with pytest.raises(ValueError, match=r"at `\$.run_id`"):
        await publisher.publish("run_../../etc", 0, 1, adapter, lora)
    with pytest.raises(ValueError, match=r">= 0 - at `\$.step`"):
        await publisher.publish(run_id, 0, -1, adapter, lora)
    assert list(tmp_path.iterdir()) == []
