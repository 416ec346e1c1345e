"""Fuzzing the trainer's decoders: the rollout stream (JetStream), the training commands
(request/reply on ``plexrl.train.>``) and the lifecycle events its run mirror follows.

Every bad payload is terminated (rollouts), answered with an error (commands) or skipped
(lifecycle), and reported as InvalidMessage on ``plexrl.errors.trainer``; the batches, commands
and lifecycle events sent around them are trained, answered and applied; the trainer keeps
running."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from schemas import subjects as sj
from schemas.events import EvictRequested, RolloutBatch, RunSubmitted, Sample, ServiceError
from schemas.training import (
    TRAIN_COMMANDS,
    Datum,
    ForwardBackwardRequest,
    LoadWeightsRequest,
    OptimStepRequest,
    OptimStepResult,
    SaveWeightsRequest,
    parse_train_subject,
    train_subject,
)
from services.bus import Bus, EmbeddedNats
from services.registry.service import Registry
from services.trainer.service import Trainer, build_model
from services.trainer.settings import TrainerSettings

from .fuzz_payloads import Thrown, Wire, decodes, fuzz, lifecycle_rejects, tokens, wires
from .fuzz_support import Reports, eventually, publish, reply_of, request, settled

LIVE, COMMANDS, GONE, CYCLING, NOBODY = "run_live", "run_cmd", "run_gone", "run_cyc", "run_nobody"


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "max_steps": 10_000,
        "model": {"lora": {"rank": 2, "alpha": 4.0}},
        "ckpt": {"interval": 1, "keep": 1},  # every trained step committed and acked at once
        **extra,
    }


def _batch(run_id: str, step: int) -> RolloutBatch:
    sample = Sample(
        prompt_ids=[5, 6, 7],
        completion_ids=[8, 9],
        completion_logprobs=[-4.0, -4.0],
        reward=1.0,
        advantage=0.5,
    )
    return RolloutBatch(run_id=run_id, step=step, policy_version=step, samples=[sample, sample])


# --- what is thrown -------------------------------------------------------------------------

ROLLOUTS = wires(
    st.sampled_from([sj.rollouts_subject(GONE), sj.tenant_rollouts_subject(GONE, "acme")])
    | st.lists(tokens, min_size=1, max_size=2).map(lambda t: "plexrl.rollouts." + ".".join(t)),
    _batch(GONE, 0),
)


def _rollout_verdict(wire: Wire) -> str:
    """``bad`` (to be terminated and reported), ``dropped`` (a batch of the evicted run, acked)
    or ``held`` (a batch of a run the trainer may still learn about: not thrown)."""
    batch = decodes(wire, RolloutBatch)
    if batch is None:
        return "bad"
    try:
        _, run_id = sj.per_run_subject(wire.subject)
    except ValueError:
        return "bad"
    if run_id != batch.run_id:
        return "bad"
    return "dropped" if batch.run_id == GONE else "held"


_DATA = [Datum(model_input=[5, 6], loss_fn_inputs={"target_tokens": [6.0, 7.0]})]
_REQUESTS: dict[str, Any] = {
    "forward_backward": ForwardBackwardRequest(request_id="fz", run_id=NOBODY, data=_DATA),
    "optim_step": OptimStepRequest(request_id="fz", run_id=NOBODY),
    "save_weights": SaveWeightsRequest(request_id="fz", run_id=NOBODY, name="fz"),
    "load_weights": LoadWeightsRequest(request_id="fz", run_id=NOBODY, path="fz"),
}
_TRAIN_SUBJECTS = st.lists(tokens, min_size=1, max_size=2).map(
    lambda t: "plexrl.train." + ".".join(t)
)


def _train_subjects(kind: str) -> st.SearchStrategy[str]:
    """The command's subjects, its subject under any tenant token, and any ``plexrl.train``
    subject at all."""
    tenant_token = tokens.map(lambda t: f"plexrl.train.{t}.{kind}")
    return (
        st.sampled_from([train_subject(kind), train_subject(kind, "acme")])
        | tenant_token
        | _TRAIN_SUBJECTS
    )


COMMANDS_THROWN = st.one_of(
    *(wires(_train_subjects(kind), request) for kind, request in _REQUESTS.items())
)

LIFECYCLE_THROWN = lifecycle_rejects(NOBODY, {})


THROWN = st.one_of(
    st.builds(
        Thrown, st.just("rollouts"), ROLLOUTS.filter(lambda w: _rollout_verdict(w) != "held")
    ),
    st.builds(Thrown, st.just("commands"), COMMANDS_THROWN, st.booleans()),
    st.builds(Thrown, st.just("lifecycle"), LIFECYCLE_THROWN),
)


def _is_bad(thrown: Thrown) -> bool:
    wire = thrown.wire
    match thrown.target:
        case "rollouts":
            return _rollout_verdict(wire) == "bad"
        case "lifecycle":
            return True
    if not thrown.with_reply:
        return True
    try:
        _, kind = parse_train_subject(wire.subject)
    except ValueError:
        return True
    return decodes(wire, TRAIN_COMMANDS[kind][0]) is None


# --- the trainer ----------------------------------------------------------------------------


@dataclass
class Cluster:
    registry: Registry
    trainer: Trainer
    bus: Bus
    reports: Reports
    steps: itertools.count[int]

    def state(self, run_id: str) -> Any:
        return next((s for s in self.trainer.states.values() if s.run_id == run_id), None)


@pytest.fixture
async def cluster(
    server: EmbeddedNats, make_registry: Any, fbus: Bus, out: Path, fuzz_model: Path
) -> AsyncIterator[Cluster]:
    registry: Registry = await make_registry(max_runs=3)
    settings = TrainerSettings(
        model=fuzz_model,
        output_dir=out,
        max_runs=3,
        max_lora_rank=4,
        micro_batch_tokens=64,
        unknown_run_hold=0.2,
        collect_ms=0.0,
    )
    tbus = await Bus.connect(server.url, settings.service)
    model, lora, pad_id, vocab_size = build_model(settings, torch.device("cpu"))
    trainer = Trainer(settings, tbus, model, lora, pad_id=pad_id, vocab_size=vocab_size)
    stop = asyncio.Event()
    task = asyncio.create_task(trainer.run(stop))
    reports = await Reports(fbus, settings.service).start()
    c = Cluster(registry, trainer, fbus, reports, itertools.count())
    # Three slots: one live run, one commands run, and one for GONE, then a run per example.
    for run_id, config in ((LIVE, _config()), (COMMANDS, _config(driver="commands"))):
        await fbus.publish(sj.SUBMIT, RunSubmitted(run_id=run_id, config=config))
    await fbus.publish(sj.SUBMIT, RunSubmitted(run_id=GONE, config=_config()))
    await eventually(lambda: _known(c, LIVE, COMMANDS), "the runs created in the trainer")
    await fbus.publish(sj.EVICT, EvictRequested(run_id=GONE, reason="its batches are dropped"))
    await eventually(lambda: _evicted(c, GONE), f"{GONE} evicted")
    yield c
    stop.set()
    await asyncio.wait_for(task, 30.0)
    await reports.stop()
    await tbus.close()


async def _known(c: Cluster, *run_ids: str) -> bool:
    return all(c.state(r) is not None for r in run_ids)


async def _evicted(c: Cluster, run_id: str) -> bool:
    record = c.registry.records.get(run_id)
    return record is not None and record.status == "evicted" and c.state(run_id) is None


async def _trained(c: Cluster, step: int) -> bool:
    state = c.state(LIVE)
    return state is not None and state.committed_step > step


async def _throw(c: Cluster, thrown: Thrown) -> None:
    wire = thrown.wire
    if thrown.target != "commands":
        await publish(c.bus, wire)
    elif not thrown.with_reply:
        await c.bus.nc.publish(wire.subject, wire.data, headers=wire.headers)
    else:
        _check_answer(wire, await request(c.bus, wire, 5.0))


def _check_answer(wire: Wire, msg: Any) -> None:
    """Every request is answered with its command's result type (an error when it was bad); a
    subject that names no command, with a ServiceError."""
    try:
        _, kind = parse_train_subject(wire.subject)
    except ValueError:
        kind = wire.subject.rsplit(".", 1)[-1]
        if kind not in TRAIN_COMMANDS:
            assert reply_of(msg, ServiceError).error, wire
            return
        assert reply_of(msg, TRAIN_COMMANDS[kind][1]).error, wire
        return
    answer = reply_of(msg, TRAIN_COMMANDS[kind][1])
    if decodes(wire, TRAIN_COMMANDS[kind][0]) is None:
        assert answer.error is not None and answer.error.startswith("invalid "), (wire, answer)
    else:  # a command for a run the trainer does not hold
        assert answer.error is not None and "unknown run" in answer.error, (wire, answer)


@fuzz(20)
@given(batch=st.lists(THROWN, min_size=1, max_size=6))
async def test_bad_rollouts_commands_and_lifecycle_events_are_rejected_and_reported(
    cluster: Cluster, batch: list[Thrown]
) -> None:
    c, bus = cluster, cluster.bus
    since = c.reports.mark()
    for thrown in batch:
        await _throw(c, thrown)
    # Good messages behind the bad ones, on every path.
    step = next(c.steps)
    await bus.publish(sj.rollouts_subject(LIVE), _batch(LIVE, step), fmt="msgpack")
    good = await bus.request(
        train_subject("optim_step"),
        OptimStepRequest(request_id=f"fence{step}", run_id=COMMANDS),
        OptimStepResult,
        timeout=10.0,
    )
    assert good.error is None and good.step == step + 1, good
    # The registry announces the eviction of the last example's run and the discovery of this
    # one; the one free slot makes the mirror apply both before it can create the new run.
    cycling = f"{CYCLING}{step}"
    if step:
        await bus.publish(sj.EVICT, EvictRequested(run_id=f"{CYCLING}{step - 1}", reason="next"))
    await bus.publish(sj.SUBMIT, RunSubmitted(run_id=cycling, config=_config()))

    await eventually(lambda: _trained(c, step), f"{LIVE} step {step} trained and committed")
    await eventually(lambda: _known(c, cycling), f"{cycling} created in the trainer")
    assert c.trainer.intake is not None
    await eventually(partial(settled, c.trainer.intake.consumer), "every rollout message settled")
    await c.reports.expect(since, [t.wire for t in batch if _is_bad(t)])
