"""The trainer service on a real NATS server with a real registry: consume, train, commit,
announce, skip redeliveries, evict bad runs."""

from __future__ import annotations

import asyncio
import math

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_support import (
    Cluster,
    eventually,
    progress_of,
    publish_batch,
    stream_events,
    submit,
    weights_events,
)
from trainer_support import make_batch, num_tokens, run_config, same_tensors, with_samples

from schemas.events import EvictRequested, RolloutBatch
from schemas.subjects import ROLLOUTS_STREAM, ROLLOUTS_WILDCARD
from services.bus import Consumer, setup_tracing
from services.model.peft_io import read_peft_dir
from services.trainer.checkpoint import complete_checkpoints, read_step_log
from services.weights import load_weights

_spans = InMemorySpanExporter()
setup_tracing("test", extra_processor=SimpleSpanProcessor(_spans))


@pytest.fixture
async def cluster(own_nats, tmp_path, tiny_dir, request):
    settings = getattr(request, "param", {})
    c = await Cluster(own_nats.url, tmp_path / "out", tiny_dir, **settings).start()
    yield c
    await c.close()


async def _weights_step(bus, run_id: str) -> int:
    return max((e.step for e in await weights_events(bus, run_id)), default=0)


async def test_runs_train_in_step_order_commit_and_skip_redeliveries(cluster, own_bus):
    bus, trainer = own_bus, cluster.trainer
    await submit(bus, "run_a", run_config(interval=2))
    await submit(bus, "run_b", run_config(interval=1, rank=2, alpha=2))
    a = [make_batch("run_a", s, num_samples=3 + s) for s in range(3)]
    b0 = make_batch("run_b", 0, num_samples=5)
    _spans.clear()
    # step 2 of run_a comes before step 1: it waits for its turn
    for batch in (a[0], a[2], b0):
        await publish_batch(bus, batch)
    await eventually(lambda: _has_step(bus, "run_b", 1))
    await asyncio.sleep(0.3)
    assert await _weights_step(bus, "run_a") == 1
    await publish_batch(bus, a[1])
    await eventually(lambda: _has_step(bus, "run_a", 3))

    progress = await progress_of(bus, "run_a")
    assert (progress.step, progress.total_samples) == (3, 3 + 4 + 5)
    assert progress.total_tokens == sum(num_tokens(x) for x in a)
    progress = await progress_of(bus, "run_b")
    assert (progress.step, progress.total_samples, progress.total_tokens) == (1, 5, num_tokens(b0))

    # WeightsReady carries the adapter exactly as the trainer holds it
    latest = (await weights_events(bus, "run_a"))[-1]
    assert (latest.step, latest.transport, latest.lora.rank, latest.lora.alpha) == (
        3,
        "object_store",
        4,
        8.0,
    )
    assert latest.digest.startswith("blake3:") and latest.size_bytes > 0
    state_a = cluster.state("run_a")
    assert same_tensors(await load_weights(bus, latest), trainer.lora.slot_state_dict(state_a.idx))
    assert [e.step for e in await weights_events(bus, "run_a")] == [1, 2, 3]

    # run_a checkpoints every 2 steps: step 2 of the batches (policy version 3) is trained,
    # announced and counted, but its batch stays unacked until a checkpoint holds it
    assert [s for s, _ in complete_checkpoints(cluster.out, "run_a")] == [2]
    assert [r["step"] for r in read_step_log(cluster.out, "run_a")] == [0, 1]
    info = await bus.js.consumer_info(ROLLOUTS_STREAM, "trainer")
    assert info.num_ack_pending == 1
    # the committed batch of step 0 (below every consumer's ack floor) left the stream; step 2's,
    # trained but not yet committed, stays for a restart to train again
    await eventually(lambda: _rollouts_left(bus, "run_a", [1, 2]))

    # a batch of a trained step arriving again (republished outside the dedupe window) is
    # acked and skipped: nothing is trained twice
    await publish_batch(bus, a[0], msg_id="run_a/step_0/again")
    await eventually(lambda: _true(trainer.intake.num_skipped == 1))
    assert (await progress_of(bus, "run_a")).step == 3

    # one trace per batch: "trainer step" under the batch's publish span, with its phases
    steps = [s for s in _spans.get_finished_spans() if s.name == "trainer step"]
    step_a2 = next(
        s for s in steps if s.attributes["run_id"] == "run_a" and s.attributes["step"] == 2
    )
    assert step_a2.attributes["policy_version"] == 3
    assert step_a2.attributes["tokens"] == num_tokens(a[2])
    children = {
        s.name
        for s in _spans.get_finished_spans()
        if s.parent and s.parent.span_id == step_a2.context.span_id
    }
    assert {"pack", "forward_backward", "optimizer"} <= children
    publish = next(
        s
        for s in _spans.get_finished_spans()
        if s.name == "publish plexrl.rollouts.run_a"
        and s.context.trace_id == step_a2.context.trace_id
    )
    assert step_a2.parent.span_id == publish.context.span_id

    # a batch far ahead is held; a clean stop commits what was trained and hands it back
    await publish_batch(bus, make_batch("run_a", 9))
    await eventually(lambda: _true("run_a" in trainer.intake.pending))
    await cluster.stop_trainer()
    assert [s for s, _ in complete_checkpoints(cluster.out, "run_a")] == [2, 3]
    assert [r["step"] for r in read_step_log(cluster.out, "run_a")] == [0, 1, 2]
    # the held batch is at once available to the next trainer on the same durable consumer
    successor = Consumer(
        bus,
        stream=ROLLOUTS_STREAM,
        durable="trainer",
        filter_subject=ROLLOUTS_WILDCARD,
        event_type=RolloutBatch,
        ack_wait=30.0,
    )
    [(batch, delivery)] = await successor.fetch(batch=8, timeout=2.0)
    assert (batch.run_id, batch.step, delivery.num_delivered) == ("run_a", 9, 2)
    await successor.close()


@pytest.mark.parametrize("cluster", [{"weight_transport": "filesystem"}], indirect=True)
async def test_bad_runs_are_evicted_and_the_good_run_trains_on(cluster, own_bus):
    bus, trainer = own_bus, cluster.trainer
    for run_id in ("run_good", "run_oov", "run_nan"):
        await submit(bus, run_id, run_config())
    await eventually(lambda: _true(len(trainer.states) == 3))
    initial = trainer.lora.slot_state_dict(cluster.state("run_good").idx)
    oov = with_samples(make_batch("run_oov", 0), prompt_ids=lambda s: [*s.prompt_ids, 95])
    nan = with_samples(
        make_batch("run_nan", 0), completion_logprobs=lambda s: [math.nan] * len(s.completion_ids)
    )
    await publish_batch(bus, oov)
    await publish_batch(bus, nan, fmt="msgpack")  # JSON has no NaN; MessagePack carries it
    await publish_batch(bus, make_batch("run_good", 0))

    evictions = await eventually(lambda: _evictions(bus, 2))
    reasons = {e.run_id: e.reason for e in evictions}
    position = len(oov.samples[0].prompt_ids) - 1
    assert reasons["run_oov"] == (
        f"rejected batch: step 0 sample 0: prompt_ids[{position}] = 95 is outside the vocabulary "
        "[0, 90) (4 of 4 samples invalid)"
    )
    assert reasons["run_nan"].startswith(
        "rejected batch: step 0 sample 0: completion_logprobs[0] = nan is not finite"
    )
    assert {e.requested_by for e in evictions} == {"trainer"}

    good = (await eventually(lambda: weights_events(bus, "run_good")))[0]
    assert (good.step, good.transport) == (1, "filesystem")
    adapter, rank, alpha, _ = read_peft_dir(good.location)
    assert (rank, alpha) == (4, 8.0)
    good_idx = cluster.state("run_good").idx
    assert same_tensors(adapter, trainer.lora.slot_state_dict(good_idx))
    assert not same_tensors(adapter, initial)
    assert await weights_events(bus, "run_oov") == []
    assert (await progress_of(bus, "run_oov")).step == 0

    # the registry evicts them, the trainer drops their state and any later batch
    await eventually(lambda: _true(len(trainer.states) == 1))
    await publish_batch(bus, make_batch("run_oov", 1))
    await eventually(lambda: _true(trainer.intake.num_dropped == 1))
    # the bad and dropped batches are acked; only run_good's step, trained but not yet in a
    # checkpoint (ckpt.interval = 50), still awaits its ack
    info = await bus.js.consumer_info(ROLLOUTS_STREAM, "trainer")
    assert info.num_ack_pending == 1


async def test_a_batch_ahead_of_its_run_discovery_is_trained_once_it_is_known(cluster, own_bus):
    bus = own_bus
    await publish_batch(bus, make_batch("run_late", 0))
    # held, then handed back (nak with delay) and redelivered while the run is unknown
    await asyncio.sleep(1.5)
    assert await weights_events(bus, "run_late") == []
    await submit(bus, "run_late", run_config(interval=1))
    await eventually(lambda: _has_step(bus, "run_late", 1))
    [record] = read_step_log(cluster.out, "run_late")
    assert record["step"] == 0 and record["delivered"] >= 2


async def _rollouts_left(bus, run_id: str, steps: list[int]) -> bool:
    left = await stream_events(bus, ROLLOUTS_STREAM, f"plexrl.rollouts.{run_id}", RolloutBatch)
    return sorted(b.step for b in left) == steps


async def _has_step(bus, run_id: str, step: int) -> bool:
    return await _weights_step(bus, run_id) >= step


async def _evictions(bus, count: int) -> list[EvictRequested] | None:
    found = await stream_events(bus, "PLEXRL_RUNS", "plexrl.runs.evict", EvictRequested)
    return found if len(found) >= count else None


async def _true(value: bool) -> bool:
    return value
