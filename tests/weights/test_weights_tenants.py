"""Weights of a tenant's run: their own object store, their own subject, pruned there."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.codec import decode
from schemas.events import WeightsReady
from schemas.subjects import WEIGHTS_STREAM
from schemas.tenant import InvalidTenant
from services.bus import Bus, EmbeddedNats
from services.weights import WeightPublisher, WeightsError, load_weights
from services.weights.listing import list_keys


async def test_a_tenant_runs_weights_live_in_its_own_store_and_are_pruned_there(
    tmp_path: Path, run_id: str, adapter, lora, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLEXRL_STREAM_REPLICAS", "1")
    with EmbeddedNats(store_dir=tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, "test")
        try:
            publisher = WeightPublisher(bus, tmp_path, keep_last=2)
            default = await publisher.publish(run_id, 0, 1, adapter, lora)
            events = [
                await publisher.publish(run_id, 0, step, adapter, lora, tenant="team-a")
                for step in (1, 2, 3)
            ]
            # created on first use, with the configured replicas
            info = await bus.js.stream_info("OBJ_plexrl-weights-team-a")
            assert info.config.num_replicas == 1
            # only the last two versions of the tenant's run are left, in the tenant's store;
            # the default tenant's run of the same id is untouched
            assert sorted(await list_keys(bus, bucket="plexrl-weights-team-a")) == [
                f"{run_id}/step_2",
                f"{run_id}/step_3",
            ]
            assert await list_keys(bus) == [default.location]
            raw = await bus.js.get_last_msg(WEIGHTS_STREAM, f"plexrl.weights.team-a.{run_id}")
            assert decode(raw.data or b"", WeightsReady) == events[-1]
            loaded = await load_weights(bus, events[-1], tenant="team-a")
            assert set(loaded) == set(adapter)
            # read from the default store, the tenant's object is not there
            with pytest.raises(WeightsError, match="not in object store 'plexrl-weights'"):
                await load_weights(bus, events[-1])
        finally:
            await bus.close()


async def test_an_illegal_tenant_is_refused_before_anything_is_stored(
    bus: Bus, tmp_path: Path, run_id: str, adapter, lora
) -> None:
    publisher = WeightPublisher(bus, tmp_path)
    with pytest.raises(InvalidTenant, match=r"illegal tenant name 'a\.b'"):
        await publisher.publish(run_id, 0, 1, adapter, lora, tenant="a.b")
    assert run_id not in {k.split("/")[0] for k in await list_keys(bus)}
