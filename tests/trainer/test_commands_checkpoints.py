"""Saved checkpoints through a real NATS server, registry and trainer: a run forks another's saved
state (its first loss is the parent's at that state), a save never replaces a checkpoint unless
told to, and the ``checkpoints`` command lists, reads, expires and deletes what a run saved, for
the run's own tenant only."""

from __future__ import annotations

import json

import pytest
from service_support import Cluster, eventually, submit
from test_commands import _commands_config, _fb, _ready, _step

from schemas.events import EvictRequested
from schemas.subjects import EVICT
from schemas.training import (
    CheckpointsRequest,
    CheckpointsResult,
    LoadWeightsRequest,
    LoadWeightsResult,
    SaveWeightsRequest,
    SaveWeightsResult,
    train_subject,
)
from services.bus import Bus


@pytest.fixture
async def cluster(own_nats, tmp_path, tiny_dir):
    c = await Cluster(own_nats.url, tmp_path / "out", tiny_dir, collect_ms=50.0).start()
    yield c
    await c.close()


async def _save(bus: Bus, run_id: str, rid: str, **kw) -> SaveWeightsResult:
    req = SaveWeightsRequest(request_id=rid, run_id=run_id, **kw)
    return await bus.request(train_subject("save_weights"), req, SaveWeightsResult, timeout=30.0)


async def _checkpoints(bus: Bus, run_id: str, rid: str, tenant: str = "default", **kw):
    req = CheckpointsRequest(request_id=rid, run_id=run_id, **kw)
    subject = train_subject("checkpoints", tenant)
    return await bus.request(subject, req, CheckpointsResult, timeout=30.0)


async def test_a_fork_starts_from_the_parents_saved_state(cluster, own_bus):
    bus = own_bus
    await submit(bus, "run_p", _commands_config())
    await _ready(cluster, "run_p")
    for i in range(2):
        assert (await _fb(bus, "run_p", f"p-fb{i}")).error is None
        assert (await _step(bus, "run_p", f"p-opt{i}")).error is None
    saved = await _save(bus, "run_p", "p-s", kind="state", name="two")
    assert saved.error is None and saved.path == "two"
    at_save = (await _fb(bus, "run_p", "p-peek", forward_only=True)).metrics["loss:sum"]
    # the parent moves on and is evicted: its checkpoint stays the tenant's to fork from
    await _fb(bus, "run_p", "p-fb2")
    await _step(bus, "run_p", "p-opt2")
    await bus.publish(EVICT, EvictRequested(run_id="run_p", reason="done"), msg_id="p/evict")
    await eventually(lambda: _gone(cluster, "run_p"))

    await submit(bus, "run_f", _commands_config())
    await _ready(cluster, "run_f")
    fresh = (await _fb(bus, "run_f", "f-peek0", forward_only=True)).metrics["loss:sum"]
    assert fresh != pytest.approx(at_save, abs=1e-4)
    loaded = await bus.request(
        train_subject("load_weights"),
        LoadWeightsRequest(request_id="f-l", run_id="run_f", path="two", source_run_id="run_p"),
        LoadWeightsResult,
        timeout=30.0,
    )
    assert loaded.error is None and loaded.step == 2
    first = await _fb(bus, "run_f", "f-fb0")
    assert first.metrics["loss:sum"] == pytest.approx(at_save, abs=1e-5)
    assert (await _step(bus, "run_f", "f-opt0")).step == 3  # the optimizer and step came too

    # another tenant cannot fork it, nor learn that it exists
    foreign = await bus.request(
        train_subject("load_weights"),
        LoadWeightsRequest(request_id="f-x", run_id="run_f", path="two", source_run_id="run_q"),
        LoadWeightsResult,
        timeout=30.0,
    )
    assert foreign.error == "unknown run run_q"


async def _gone(cluster: Cluster, run_id: str) -> bool:
    return cluster.state(run_id) is None


async def test_checkpoints_are_listed_read_expired_and_deleted_for_their_tenant(cluster, own_bus):
    bus = own_bus
    await submit(bus, "run_c", _commands_config())
    await _ready(cluster, "run_c")
    await _fb(bus, "run_c", "fb0")
    await _step(bus, "run_c", "opt0")
    assert (await _save(bus, "run_c", "s1", kind="state", name="one")).error is None
    again = await _save(bus, "run_c", "s2", kind="state", name="one", overwrite=False)
    assert again.error is not None and "already has a checkpoint named 'one'" in again.error
    assert (await _save(bus, "run_c", "s3", kind="state", name="one")).error is None
    assert (await _save(bus, "run_c", "s4", kind="sampler", name="snap")).path == "run_c@1"

    listed = await _checkpoints(bus, "run_c", "c1")
    assert listed.error is None
    by_name = {(c.kind, c.name): c for c in listed.checkpoints}
    assert set(by_name) == {("state", "one"), ("sampler", "snap")}
    one = by_name[("state", "one")]
    assert (one.step, one.rank, one.expires_at) == (1, 4, 0.0)
    assert {f.path for f in one.files} == {"adapter_config.json", "adapter_model.safetensors"}
    assert by_name[("sampler", "snap")].step == 1

    config = await _checkpoints(
        bus, "run_c", "c2", op="read", name="one", file="adapter_config.json", length=1 << 19
    )
    assert json.loads(config.data)["r"] == 4
    size = next(f.size_bytes for f in one.files if f.path == "adapter_model.safetensors")
    chunks = [
        await _checkpoints(
            bus, "run_c", f"r{o}", op="read", name="one", file="adapter_model.safetensors",
            offset=o, length=4096,
        )
        for o in range(0, size, 4096)
    ]  # fmt: skip
    on_disk = (
        cluster.out / "run_c" / "checkpoints" / "one" / "adapter" / "adapter_model.safetensors"
    )
    assert b"".join(c.data for c in chunks) == on_disk.read_bytes()
    refused = await _checkpoints(bus, "run_c", "c3", op="read", name="one", file="optimizer.pt")
    assert refused.error is not None and "no adapter file 'optimizer.pt'" in refused.error

    # another tenant: the same answer as for a run that does not exist, and nothing changes
    for rid, op in (("x1", "list"), ("x2", "delete")):
        other = await _checkpoints(bus, "run_c", rid, tenant="acme", op=op, name="one")
        assert other.error == "unknown run run_c" and other.checkpoints == []
    assert (await _checkpoints(bus, "run_nope", "x3")).error == "unknown run run_nope"

    expiring = await _checkpoints(bus, "run_c", "e1", op="expire", name="one", ttl_s=1e-3)
    assert expiring.error is None
    listed = await _checkpoints(bus, "run_c", "c4")
    assert [(c.kind, c.name) for c in listed.checkpoints] == [("sampler", "snap")]
    assert not (cluster.out / "run_c" / "checkpoints" / "one").exists()
    assert (
        await _checkpoints(bus, "run_c", "d1", op="delete", kind="sampler", name="snap")
    ).error is None
    assert (await _checkpoints(bus, "run_c", "c5")).checkpoints == []
