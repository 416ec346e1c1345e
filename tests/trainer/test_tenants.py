"""Tenants at the trainer, on a real NATS server: a tenant's batches train only its own runs,
and a tenant run's weights, progress and metrics carry its tenant."""

from __future__ import annotations

import asyncio

import pytest
import torch
from service_support import eventually, progress_of, stream_events
from trainer_support import make_batch, run_config, same_tensors

from schemas import subjects as sj
from schemas.codec import decode
from schemas.config import orch_config_from_dict
from schemas.events import EvictRequested, InvalidMessage, WeightsReady
from schemas.records import RunRecord
from services.bus import Bus
from services.trainer.service import Trainer, build_model
from services.trainer.settings import TrainerSettings
from services.weights import load_weights
from services.weights.listing import list_keys


async def _announce(bus: Bus, run_id: str, idx: int, tenant: str) -> None:
    config = orch_config_from_dict(run_config())
    record = RunRecord(
        run_id=run_id,
        status="active",
        idx=idx,
        config=config.to_dict(),
        config_digest=config.digest(),
        tenant=tenant,
    )
    owed = record.lifecycle_event()
    assert owed is not None
    subject, msg_id, event = owed
    await bus.publish(subject, event, msg_id=msg_id)


@pytest.fixture
async def trainer(own_nats, tmp_path, tiny_dir):
    settings = TrainerSettings(
        model=tiny_dir,
        output_dir=tmp_path / "out",
        max_runs=3,
        max_lora_rank=8,
        micro_batch_tokens=128,
        ack_wait=30.0,
        unknown_run_hold=0.5,
    )
    bus = await Bus.connect(own_nats.url, "trainer")
    model, lora, pad_id, vocab_size = build_model(settings, torch.device("cpu"))
    t = Trainer(settings, bus, model, lora, pad_id=pad_id, vocab_size=vocab_size)
    stop = asyncio.Event()
    task = asyncio.create_task(t.run(stop))
    yield t
    stop.set()
    await asyncio.wait_for(task, 30.0)
    await bus.close()


def _state(trainer: Trainer, run_id: str):
    return next((s for s in trainer.states.values() if s.run_id == run_id), None)


async def test_a_batch_from_another_tenant_is_refused_and_its_run_keeps_its_step(
    trainer: Trainer, own_bus: Bus
) -> None:
    bus = own_bus
    await _announce(bus, "run_a", 0, "acme")
    await _announce(bus, "run_b", 1, "beta")
    await eventually(lambda: _async(len(trainer.states) == 2))
    assert (_state(trainer, "run_a").tenant, _state(trainer, "run_b").tenant) == ("acme", "beta")
    victim = _adapter(trainer, 1)

    forged = make_batch("run_b", 0, seed=9)
    await bus.publish("plexrl.rollouts.acme.run_b", forged, msg_id="forged")
    await bus.publish("plexrl.rollouts.acme.run_a", make_batch("run_a", 0), msg_id="a0")
    await eventually(lambda: _async(_state(trainer, "run_a").progress.step == 1))
    assert trainer.intake is not None and trainer.intake.num_wrong_tenant == 1
    assert _state(trainer, "run_b").progress.step == 0 and "run_b" not in trainer.refused
    # the forged batch moved none of run_b's adapter
    assert same_tensors(_adapter(trainer, 1), victim)
    assert await stream_events(bus, sj.RUNS_STREAM, sj.EVICT, EvictRequested) == []
    [report] = await eventually(
        lambda: stream_events(bus, "PLEXRL_ERRORS", "plexrl.errors.trainer", InvalidMessage)
    )
    assert report.subject == "plexrl.rollouts.acme.run_b"
    assert "tenant 'acme' sent a RolloutBatch (step 0) for run_b" in report.error

    # run_a's weights and progress are acme's
    [event] = await eventually(
        lambda: stream_events(bus, sj.WEIGHTS_STREAM, "plexrl.weights.acme.run_a", WeightsReady)
    )
    assert event.step == 1 and event.location in await list_keys(bus, bucket="plexrl-weights-acme")
    # and announced no weights of run_b, under any subject
    assert [(e.run_id, e.step) for e in await _all_weights(bus)] == [("run_a", 1)]
    loaded = await load_weights(bus, event, tenant="acme")
    assert set(loaded) == set(trainer.lora.slot_state_dict(0))
    progress = await eventually(lambda: _progress_at(bus, "run_a", 1))
    assert progress.tenant == "acme"

    # beta's own batch of the same step trains run_b as usual
    await bus.publish("plexrl.rollouts.beta.run_b", make_batch("run_b", 0), msg_id="b0")
    progress = await eventually(lambda: _progress_at(bus, "run_b", 1))
    assert progress.tenant == "beta" and _state(trainer, "run_b").progress.step == 1


def _adapter(trainer: Trainer, idx: int) -> dict[str, torch.Tensor]:
    return {k: t.clone() for k, t in trainer.lora.slot_state_dict(idx).items()}


async def _all_weights(bus: Bus) -> list[WeightsReady]:
    """Every WeightsReady in the stream, whatever its subject."""
    info = await bus.js.stream_info(sj.WEIGHTS_STREAM)
    first, last = info.state.first_seq, info.state.last_seq
    raws = [await bus.js.get_msg(sj.WEIGHTS_STREAM, seq) for seq in range(first, last + 1)]
    return [decode(raw.data or b"", WeightsReady) for raw in raws]


async def _progress_at(bus: Bus, run_id: str, step: int):
    progress = await progress_of(bus, run_id)
    return progress if progress is not None and progress.step == step else None


async def _async(value: bool) -> bool:
    return value
