"""The commit of a run's step, in process: checkpoint, step log, WeightsReady, progress and ack,
in that order, each with the right arguments; refusals, redeliveries, a clean stop and a resume.

The bus, the publisher and the mirror are recorders here (the service tests drive the real ones
over NATS); the checkpoint and the step log are written for real.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    StatusCode,
    TraceFlags,
    set_span_in_context,
)
from torch.optim.lr_scheduler import LambdaLR
from trainer_support import config, make_batch, same_tensors

from schemas.records import Progress
from schemas.subjects import ROLLOUTS_STREAM
from services.bus import setup_tracing
from services.trainer import commit
from services.trainer.checkpoint import (
    append_step_log,
    complete_checkpoints,
    read_step_log,
    recover_step_log,
    save_checkpoint,
)
from services.trainer.commit import Committer
from services.trainer.intake import Held
from services.trainer.loss import RunLossStats
from services.trainer.state import RunState
from services.trainer.step import RunResult

_spans = InMemorySpanExporter()
setup_tracing("test", extra_processor=SimpleSpanProcessor(_spans))

RUN = "run_a"
SUBJECT = "plexrl.rollouts.acme.run_a"
T0 = 1_700_000_000_000_000_000
"""The step's start, in ns since the epoch"""
PHASES = {
    "pack": (T0, T0 + 1_000_000),
    "forward_backward": (T0 + 1_000_000, T0 + 4_000_000),
    "optimizer": (T0 + 4_000_000, T0 + 6_500_000),
}
REMOTE = SpanContext(0x5EED, 0xBA7C4, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
"""The span of whoever published a batch, as its message's headers carry it"""


@dataclass
class FakeDelivery:
    log: list[Any]
    stream_sequence: int
    num_delivered: int = 1
    stored: datetime | None = None
    context: Any = field(default_factory=otel_context.Context)

    @property
    def msg(self) -> Any:
        metadata = None if self.stored is None else SimpleNamespace(timestamp=self.stored)
        return SimpleNamespace(subject=SUBJECT, metadata=metadata)

    async def ack(self) -> None:
        self.log.append(("ack", self.stream_sequence))


class FakePublisher:
    def __init__(self, log: list[Any]) -> None:
        self.log = log
        self.published: list[dict[str, Any]] = []

    async def publish(self, run_id, idx, step, tensors, lora, **kw) -> None:
        self.log.append(("publish", run_id, step))
        self.published.append(
            {"run_id": run_id, "idx": idx, "step": step, "tensors": tensors, "lora": lora, **kw}
        )


class FakeSlots:
    """One LoRA slot (idx 1) of one layer: what the committer publishes and checkpoints."""

    kind = "lora"
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"

    def __init__(self) -> None:
        self.a = torch.arange(8.0).reshape(4, 2)
        self.b = torch.arange(12.0).reshape(3, 4) / 10

    def slot_state_dict(self, idx: int) -> dict[str, torch.Tensor]:
        assert idx == 1
        return {f"{self.prefix}.lora_A.weight": self.a, f"{self.prefix}.lora_B.weight": self.b}


class FakeMirror:
    def __init__(self, log: list[Any], known: set[int]) -> None:
        self.log, self.known = log, known

    async def evict_run(self, idx: int, reason: str) -> None:
        if idx not in self.known:
            raise KeyError(idx)
        self.log.append(("evict", idx, reason))


@dataclass
class Bench:
    """A committer on a tiny model with recorders around it; ``log`` holds what happened."""

    slots: FakeSlots
    run: RunState
    committer: Committer
    publisher: FakePublisher
    log: list[Any]
    metrics: list[dict[str, Any]]
    out: Path

    def state(self) -> RunState:
        return self.run

    def delivery(self, seq: int, **kw: Any) -> FakeDelivery:
        return FakeDelivery(self.log, seq, **kw)

    def held(self, step: int, seq: int, **kw: Any) -> Held:
        batch = make_batch(RUN, step, num_samples=2)
        return Held(batch, self.delivery(seq, **kw), tenant="acme")  # type: ignore[arg-type]

    async def step(self, step: int, seq: int, **kw: Any) -> Held:
        """Train (pretend) and commit ``step`` of run_a, from the batch at ``seq``."""
        state = self.state()
        state.advance(30 + step, 2, 0.25)
        held = self.held(step, seq, **kw)
        await self.committer.finish(state, _result(step), held, PHASES)
        return held


def _result(step: int, **kw: Any) -> RunResult:
    stats = RunLossStats(num_tokens=10, num_clipped=2, ratio_sum=11.0, ratio_max=1.5, kl_sum=0.5)
    fields = {"loss": 0.75, "num_tokens": 30 + step, "num_samples": 2, "grad_norm": 1.25}
    fields |= {"lr": 1e-3, "reward_mean": 0.25, "stats": stats, "trained": True}
    return RunResult(slot=1, run_id=RUN, step=step, **(fields | kw))


@pytest.fixture
def bench(tmp_path, monkeypatch) -> Bench:
    log: list[Any] = []
    metrics: list[dict[str, Any]] = []

    async def progress(bus: Any, run_id: str, p: Any) -> None:
        assert bus.js == "the js"  # the committer's own bus
        log.append(("progress", run_id, p.step, p.total_tokens, p.total_samples, p.tenant))

    async def purge(js: Any, stream: str, subject: str, seq: int, *, lost: Any) -> None:
        assert js == "the js" and lost == "lost"
        log.append(("purge", stream, subject, seq))

    def checkpoint(out: Path, run_id: str, ckpt: Any, keep: int) -> Path:
        assert out == tmp_path / "out"
        log.append(("checkpoint", run_id, ckpt.step, keep))
        return save_checkpoint(out, run_id, ckpt, keep)

    def step_log(out: Path, run_id: str, records: Any) -> None:
        records = list(records)
        log.append(("step_log", run_id, [r["step"] for r in records]))
        append_step_log(out, run_id, records)

    def recover(out: Path, run_id: str, committed: int) -> list[int]:
        log.append(("recover", run_id, committed))
        return recover_step_log(out, run_id, committed)

    # the files are written for real, not flushed to the disk: durability is checkpoint.py's
    monkeypatch.setattr(os, "fsync", lambda fd: None)

    def crash(point: str, run_id: str, at: int) -> None:
        assert run_id == RUN, f"{point} named run {run_id!r}"
        log.append((point, at))

    monkeypatch.setattr(commit, "crash_point", crash)
    monkeypatch.setattr(commit, "write_progress", progress)
    monkeypatch.setattr(commit, "purge_consumed", purge)
    monkeypatch.setattr(commit, "save_checkpoint", checkpoint)
    monkeypatch.setattr(commit, "append_step_log", step_log)
    monkeypatch.setattr(commit, "recover_step_log", recover)
    monkeypatch.setattr(
        commit, "record_trainer_step", lambda run_id, **kw: metrics.append({"run": run_id, **kw})
    )
    monkeypatch.delenv("PLEXRL_ROLLOUTS_KEEP_HISTORY", raising=False)
    slots = FakeSlots()
    cfg = config(interval=2, max_steps=5)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    run = RunState(
        idx=1,
        run_id=RUN,
        config=cfg,
        config_digest=cfg.digest(),
        target_modules=("q_proj",),
        optimizer=optimizer,
        scheduler=LambdaLR(optimizer, lambda _: 1.0),
        progress=Progress(step=0, total_tokens=0, total_samples=0, tenant="acme"),
        tenant="acme",
    )
    publisher = FakePublisher(log)
    out = tmp_path / "out"
    committer = Committer(
        # the committer's bus: its JetStream and its reconnects (stand-ins the fakes recognise)
        SimpleNamespace(js="the js", reconnects=SimpleNamespace(lost="lost")),  # type: ignore[arg-type]
        slots,  # type: ignore[arg-type]
        FakeMirror(log, {1}),  # type: ignore[arg-type]
        publisher,  # type: ignore[arg-type]
        out,
        base_model_path="/models/tiny",
    )
    _spans.clear()
    return Bench(slots, run, committer, publisher, log, metrics, out)


def _progress(step: int) -> tuple[Any, ...]:
    """What progress.write records after ``step`` steps of ``Bench.step``."""
    return ("progress", RUN, step, sum(30 + s for s in range(step)), 2 * step, "acme")


async def test_a_step_is_checkpointed_logged_announced_recorded_then_acked(bench: Bench) -> None:
    await bench.step(0, seq=11)  # progress 1: no checkpoint due (interval 2)
    assert bench.log == [
        ("trainer.train", 0),
        ("publish", RUN, 1),
        ("trainer.publish", 0),
        _progress(1),
        ("trainer.progress", 0),
    ]
    assert complete_checkpoints(bench.out, RUN) == []
    assert list(bench.committer.deliveries()) and bench.state().committed_step == 0
    bench.log.clear()

    await bench.step(1, seq=12)  # progress 2: checkpoint, then both steps acked
    assert bench.log == [
        ("trainer.train", 1),
        ("checkpoint", RUN, 2, 2),
        ("trainer.checkpoint", 1),
        ("step_log", RUN, [0, 1]),
        ("publish", RUN, 2),
        ("trainer.publish", 1),
        _progress(2),
        ("trainer.progress", 1),
        ("ack", 11),
        ("ack", 12),
        ("purge", ROLLOUTS_STREAM, SUBJECT, 12),
        ("trainer.ack", 1),
    ]
    assert bench.state().committed_step == 2 and list(bench.committer.deliveries()) == []
    [(step, _)] = complete_checkpoints(bench.out, RUN)
    assert step == 2

    # the step log: one line per committed step, what was trained and how it went
    records = read_step_log(bench.out, RUN)
    times = [r.pop("time") for r in records]
    assert times == sorted(times)
    for step, record in enumerate(records):
        assert record == {
            "run_id": RUN,
            "weights": "lora",
            "step": step,
            "policy_version": step + 1,
            "stream_seq": 11 + step,
            "delivered": 1,
            "batch_policy_version": step,
            "samples": 2,
            "tokens": 30 + step,
            "loss_tokens": 10,
            "loss": 0.75,
            "grad_norm": 1.25,
            "lr": 1e-3,
            "reward_mean": 0.25,
            "clipped_fraction": 0.2,
            "ratio_mean": 1.1,
            "ratio_max": 1.5,
            "kl_mean": 0.05,
            "pid": os.getpid(),
        }

    # what was announced: the slot's adapter as it is, for the run's tenant
    published = bench.publisher.published[-1]
    tensors, lora = published.pop("tensors"), published.pop("lora")
    assert published == {
        "run_id": RUN,
        "idx": 1,
        "step": 2,
        "base_model_path": "/models/tiny",
        "kind": "lora",
        "tenant": "acme",
    }
    assert same_tensors(tensors, bench.slots.slot_state_dict(1))
    assert lora == bench.state().lora_spec


async def test_the_step_log_times_its_lines(bench: Bench) -> None:
    before = time.time()
    await bench.step(0, seq=11)
    await bench.step(1, seq=12)
    after = time.time()
    assert all(before <= r["time"] <= after for r in read_step_log(bench.out, RUN))


async def test_a_step_is_traced_and_measured(bench: Bench) -> None:
    stored = datetime.fromtimestamp(T0 / 1e9 - 2.5, tz=UTC)  # 2.5 s before the step's start
    # the batch's message carries its publisher's span: the step continues that trace
    await bench.step(
        0, seq=11, stored=stored, context=set_span_in_context(NonRecordingSpan(REMOTE))
    )
    await bench.step(1, seq=12)  # no JetStream metadata: no queue wait
    spans = _spans.get_finished_spans()
    steps = [s for s in spans if s.name == "trainer step"]
    assert [dict(s.attributes or {}) for s in steps] == [
        {
            "run_id": RUN,
            "idx": 1,
            "step": step,
            "policy_version": step + 1,
            "tokens": 30 + step,
            "samples": 2,
            "loss": 0.75,
            "weights": "lora",
        }
        for step in (0, 1)
    ]
    assert steps[0].start_time == T0
    assert steps[0].parent == REMOTE and steps[0].context.trace_id == REMOTE.trace_id
    assert steps[1].parent is None  # a message without a trace starts one
    assert {s.instrumentation_scope.name for s in spans} == {"plexrl.trainer"}
    children = [(s.name, s.start_time, s.end_time, s.parent) for s in spans if s.name in PHASES]
    assert [c[:3] for c in children[:3]] == [(n, a, b) for n, (a, b) in PHASES.items()]
    assert all(c[3] is not None and c[3].span_id == steps[0].context.span_id for c in children[:3])
    [checkpoint] = [s for s in spans if s.name == "checkpoint"]
    assert dict(checkpoint.attributes or {}) == {"step": 2}
    assert [m.pop("queue_wait") for m in bench.metrics] == [pytest.approx(2.5, abs=1e-5), None]
    assert bench.metrics == [
        {"run": RUN, "tenant": "acme", "seconds": 6.5e-3, "tokens": 30 + step, "samples": 2}
        for step in (0, 1)
    ]


async def test_a_refused_step_is_acked_and_its_run_evicted(bench: Bench) -> None:
    traced = set_span_in_context(NonRecordingSpan(REMOTE))
    state, held = bench.state(), bench.held(0, seq=21, context=traced)
    await bench.committer.refuse(state, _result(0, trained=False), held)
    assert bench.log == [("ack", 21), ("evict", 1, "step 0 refused")]
    bench.log.clear()
    await bench.committer.refuse(state, _result(0, trained=False, reason="grad is nan"), held)
    assert bench.log == [("ack", 21), ("evict", 1, "grad is nan")]
    [span, _] = [s for s in _spans.get_finished_spans() if s.name == "trainer step"]
    assert dict(span.attributes or {}) == {"run_id": RUN, "idx": 1, "step": 0}
    assert span.parent == REMOTE  # in the trace of the batch it refuses
    assert (span.status.status_code, span.status.description) == (
        StatusCode.ERROR,
        "step 0 refused",
    )
    bench.log.clear()
    await bench.committer.evict(0, "gone")  # slot 0 is empty: nothing to evict, no error
    assert bench.log == []


async def test_a_redelivery_replaces_its_delivery_and_an_untracked_one_is_acked(
    bench: Bench,
) -> None:
    await bench.step(0, seq=11)
    bench.log.clear()
    again = bench.held(0, seq=11, num_delivered=2)
    await bench.committer.attach(again)  # the same message: its newest delivery acks it
    other = bench.held(0, seq=15)
    await bench.committer.attach(other)  # a second message of the step: acked with it
    assert bench.log == []
    waiting = list(bench.committer.deliveries())
    assert len(waiting) == 2 and waiting[0] is again.delivery and waiting[1] is other.delivery
    await bench.committer.attach(bench.held(4, seq=30))  # a step not tracked: acked at once
    assert bench.log == [("ack", 30)]
    bench.log.clear()
    stranger = Held(make_batch("run_b", 0, num_samples=2), bench.delivery(31), tenant="acme")
    await bench.committer.attach(stranger)  # a run with nothing tracked: acked at once too
    assert bench.log == [("ack", 31)]
    bench.log.clear()
    await bench.committer.forget(RUN)  # the run is deleted: what waited is acked, none kept
    assert bench.log == [("ack", 11), ("ack", 15), ("purge", ROLLOUTS_STREAM, SUBJECT, 15)]
    assert list(bench.committer.deliveries()) == []
    bench.log.clear()
    await bench.committer.forget("run_b")  # nothing waits for a run that trained nothing here
    assert bench.log == []


async def test_a_clean_stop_checkpoints_only_what_is_not_committed(bench: Bench) -> None:
    await bench.committer.flush(bench.state())
    assert bench.log == []
    await bench.step(0, seq=11)
    bench.log.clear()
    await bench.committer.flush(bench.state())
    assert bench.log == [
        ("checkpoint", RUN, 1, 2),
        ("trainer.checkpoint", 0),
        ("step_log", RUN, [0]),
        ("ack", 11),
        ("purge", ROLLOUTS_STREAM, SUBJECT, 11),
    ]
    assert bench.state().committed_step == 1
    assert [r["step"] for r in read_step_log(bench.out, RUN)] == [0]


async def test_keeping_history_purges_nothing(bench: Bench, monkeypatch) -> None:
    monkeypatch.setenv("PLEXRL_ROLLOUTS_KEEP_HISTORY", "1")
    keeper = Committer(
        bench.committer.bus,
        bench.slots,  # type: ignore[arg-type]
        bench.committer.mirror,
        bench.publisher,  # type: ignore[arg-type]
        bench.out,
    )
    state = bench.state()
    state.advance(30, 2, 0.25)
    state.advance(31, 2, 0.25)
    await keeper.finish(state, _result(1), bench.held(1, seq=12), PHASES)
    assert ("ack", 12) in bench.log and not [e for e in bench.log if e[0] == "purge"]
    assert bench.publisher.published[-1]["base_model_path"] == ""


async def test_a_resume_repairs_the_log_rewrites_progress_and_announces_its_version(
    bench: Bench,
) -> None:
    state = bench.state()
    await bench.committer.resume(state)  # a fresh run: progress 0, nothing to announce
    assert bench.log == [_progress(0)]
    bench.log.clear()
    state.advance(30, 2, 0.25)
    state.committed_step, state.resumed_from = 1, 1
    await bench.committer.resume(state)  # version 1 is announced again, as any other
    assert bench.log == [("recover", RUN, 1), _progress(1), ("publish", RUN, 1)]
    bench.log.clear()
    state.advance(31, 2, 0.25)
    state.committed_step, state.resumed_from = 2, 2
    await bench.committer.resume(state)
    assert bench.log == [("recover", RUN, 2), _progress(2), ("publish", RUN, 2)]
