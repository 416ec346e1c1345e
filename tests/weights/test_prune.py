"""Old weight versions leave the object store for good, so its size follows the runs, not the
steps; and a store that is full pauses the trainer's publish until there is room."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
import torch

from schemas.events import LoraSpec
from schemas.subjects import WEIGHTS_STREAM, weights_subject
from services.bus import Bus, EmbeddedNats, limits, provision
from services.weights import WeightPublisher, load_weights
from services.weights.listing import list_keys

STORE = "OBJ_plexrl-weights"


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "FIRST_DELAY", 0.05)
    monkeypatch.setattr(limits, "MAX_DELAY", 0.1)


async def _store_state(bus: Bus) -> tuple[int, int]:
    state = (await bus.js.stream_info(STORE)).state
    return state.messages, state.bytes


async def test_pruned_versions_free_their_space_so_the_store_stops_growing(
    server: EmbeddedNats, tmp_path: Path, make_adapter, lora: LoraSpec
) -> None:
    bus = await Bus.connect(server.url, "trainer")
    try:
        publisher = WeightPublisher(bus, tmp_path, keep_last=2)
        sizes = []
        for step in range(1, 11):
            for run_id in ("run_a", "run_b"):
                await publisher.publish(run_id, 0, step, make_adapter(step), lora)
            sizes.append(await _store_state(bus))
        assert sorted(await list_keys(bus)) == [
            "run_a/step_10",
            "run_a/step_9",
            "run_b/step_10",
            "run_b/step_9",
        ]
        # Each version is one chunk and one description; nothing else stays behind (no
        # tombstones, no orphaned chunks), so from step 2 on the store holds the same (give or
        # take the digits of a step number in the keys).
        assert {messages for messages, _ in sizes[1:]} == {2 * 2 * 2}
        steady = [size for _, size in sizes[1:]]
        assert max(steady) - min(steady) < 100
        # The announcements are bounded per run too: the newest 8 of each.
        info = await bus.js.stream_info(WEIGHTS_STREAM, subjects_filter=">")
        assert info.state.subjects == {weights_subject("run_a"): 8, weights_subject("run_b"): 8}
    finally:
        await bus.close()


async def test_a_full_weights_store_pauses_the_publish_until_the_limit_is_raised(
    server: EmbeddedNats,
    tmp_path: Path,
    make_adapter,
    lora: LoraSpec,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="services.bus.limits")
    bus = await Bus.connect(server.url, "trainer")
    try:
        publisher = WeightPublisher(bus, tmp_path, keep_last=2)
        await publisher.publish("run_a", 0, 1, make_adapter(1), lora)
        one_version = (await _store_state(bus))[1]
        # Room for two versions: keep_last = 2 needs three while the newest is being stored.
        monkeypatch.setenv("PLEXRL_WEIGHTS_STORE_MAX_BYTES", str(int(2.5 * one_version)))
        assert await provision(bus.js) == ["updated object store plexrl-weights"]
        await publisher.publish("run_a", 0, 2, make_adapter(2), lora)

        publishing = asyncio.create_task(publisher.publish("run_a", 0, 3, make_adapter(3), lora))
        await asyncio.wait_for(_until_paused(caplog), 10.0)
        assert "object store plexrl-weights is full" in caplog.text
        assert "Raise PLEXRL_WEIGHTS_STORE_MAX_BYTES" in caplog.text
        assert not publishing.done()
        # Nothing of step 3 is stored or announced while it waits, and a half-written version
        # holds no space.
        assert sorted(await list_keys(bus)) == ["run_a/step_1", "run_a/step_2"]
        assert (await _store_state(bus))[0] == 4
        last = await bus.js.get_last_msg(WEIGHTS_STREAM, weights_subject("run_a"))
        assert b'"step":2' in (last.data or b"")

        monkeypatch.setenv("PLEXRL_WEIGHTS_STORE_MAX_BYTES", str(4 * one_version))
        assert await provision(bus.js) == ["updated object store plexrl-weights"]
        event = await asyncio.wait_for(publishing, 10.0)
        assert event.step == 3
        loaded = await load_weights(bus, event)
        assert all(torch.equal(loaded[k], v) for k, v in make_adapter(3).items())
        assert sorted(await list_keys(bus)) == ["run_a/step_2", "run_a/step_3"]
    finally:
        await bus.close()


async def _until_paused(caplog: pytest.LogCaptureFixture) -> None:
    while not any("paused" in r.getMessage() for r in caplog.records):
        await asyncio.sleep(0.02)
