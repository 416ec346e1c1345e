"""Rank 0's end of a run's step: checkpoint, step log, WeightsReady, progress, ack, in that order.

The order makes a crash at any point neither skip nor repeat a step:

1. **checkpoint** (when ``ckpt.interval`` asks for one): written atomically; this is the commit
   point. A restart resumes from the newest complete checkpoint, so a step is durable exactly
   when a checkpoint holds it.
2. **step log**: one fsync'd line per newly committed step (``trainer_steps.jsonl``); a crash
   right before it is repaired from the checkpoint on restart (:func:`recover_step_log`).
3. **WeightsReady** for policy version ``step + 1`` with message id ``<run_id>/weights/step_<n>``:
   a restart republishes the version its checkpoint holds, and the stream drops the copy if the
   first publish had landed. A full-weight trainer announces the whole model (``kind="full"``).
4. **progress** in KV ``plexrl-progress``: rewritten from the checkpoint on restart.
5. **ack** of every batch the checkpoint now holds. Until then a trained batch stays unacked
   (kept alive by in-progress signals), so after a crash the server redelivers exactly the
   batches of the steps that must be trained again; those the checkpoint holds are acked and
   skipped by the intake. With ``ckpt.interval = 1`` nothing is ever retrained. The run's
   batches stored before the newest acked one, and below every consumer's ack floor, are then
   purged from the stream (the newest stays: a restarted orchestrator resumes after it; not with
   ``PLEXRL_ROLLOUTS_KEEP_HISTORY``), so the
   stream holds the backlog, not the history.

Between checkpoints (interval > 1) WeightsReady and progress are still published after every
step; a crash then retrains the steps after the checkpoint from their redelivered batches and
announces those versions again.

``PLEXRL_FAULT=trainer.<point>[@<run_id>][:<step>]`` (points: ``train``, ``checkpoint``,
``publish``, ``progress``, ``ack``; see :mod:`services.launch.faults`) exits the process with
status 137 right after that point, which is how the tests crash the trainer between two of
these writes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace

from schemas.subjects import ROLLOUTS_STREAM
from services.bus import Bus, Delivery
from services.bus.limits import purge_consumed
from services.config.process import process_settings
from services.launch.faults import crash_point
from services.runs.mirror import RunMirror
from services.runs.progress import write_progress
from services.telemetry.metrics import record_trainer_step
from services.trainer.checkpoint import append_step_log, recover_step_log, save_checkpoint
from services.trainer.intake import Held
from services.trainer.slots import WeightSlots
from services.trainer.state import RunState
from services.trainer.step import RunResult
from services.weights import WeightPublisher

log = logging.getLogger(__name__)


@dataclass
class _Trained:
    """A trained step not yet held by a checkpoint."""

    step: int
    record: dict[str, Any]
    deliveries: list[Delivery] = field(default_factory=list)


class Committer:
    """Commits, announces and acknowledges each run's steps; rank 0 only."""

    def __init__(
        self,
        bus: Bus,
        lora: WeightSlots,
        mirror: RunMirror,
        publisher: WeightPublisher,
        output_dir: Path,
        *,
        base_model_path: str = "",
    ) -> None:
        self.bus = bus
        self.lora = lora
        self.kind = lora.kind
        """what is published: 'lora' adapters, or the 'full' model of a full-weight trainer"""
        self.mirror = mirror
        self.publisher = publisher
        self.output_dir = output_dir
        self.base_model_path = base_model_path
        self._tracer = trace.get_tracer("plexrl.trainer")
        self._trained: dict[str, list[_Trained]] = {}
        self._keep_history = process_settings().rollouts_keep_history

    # --- after a step ----------------------------------------------------------------------------

    async def finish(
        self,
        state: RunState,
        result: RunResult,
        held: Held,
        phases: dict[str, tuple[int, int]],
    ) -> None:
        """Commit and announce ``state``'s step ``result.step`` (already applied to ``state``)."""
        record_trainer_step(
            state.run_id,
            tenant=state.tenant,
            seconds=(max(end for _, end in phases.values()) - phases["pack"][0]) / 1e9,
            tokens=result.num_tokens,
            samples=result.num_samples,
            queue_wait=_queue_wait(held, phases["pack"][0]),
        )
        run_id, step = state.run_id, result.step
        span = self._tracer.start_span(
            "trainer step",
            context=held.delivery.context,
            start_time=phases["pack"][0],
            attributes={
                "run_id": run_id,
                "idx": state.idx,
                "step": step,
                "policy_version": step + 1,
                "tokens": result.num_tokens,
                "samples": result.num_samples,
                "loss": result.loss,
                "weights": self.kind,
            },
        )
        parent = trace.set_span_in_context(span)
        for name, (start, end) in phases.items():
            self._tracer.start_span(name, context=parent, start_time=start).end(end_time=end)
        with trace.use_span(span, end_on_exit=True):
            self._trained.setdefault(run_id, []).append(
                _Trained(step, _record(state, result, held, self.kind), [held.delivery])
            )
            crash_point("trainer.train", run_id, step)
            committed = state.checkpoint_due()
            if committed:
                await self._checkpoint(state)
            await self._publish(state)
            crash_point("trainer.publish", run_id, step)
            await write_progress(self.bus, run_id, state.progress)
            crash_point("trainer.progress", run_id, step)
            if committed:
                await self._ack_committed(run_id)
                crash_point("trainer.ack", run_id, step)

    async def refuse(self, state: RunState, result: RunResult, held: Held) -> None:
        """Ack the refused batch (its step is not applied) and ask for the run's eviction."""
        reason = result.reason or f"step {result.step} refused"
        log.warning("trainer: evicting %s: %s", state.run_id, reason)
        with self._tracer.start_as_current_span(
            "trainer step",
            context=held.delivery.context,
            attributes={"run_id": state.run_id, "idx": state.idx, "step": result.step},
        ) as span:
            span.set_status(trace.Status(trace.StatusCode.ERROR, reason))
            await held.delivery.ack()
            await self.evict(state.idx, reason)

    async def evict(self, idx: int, reason: str) -> None:
        try:
            await self.mirror.evict_run(idx, reason)
        except KeyError:  # the run left the mirror since; nothing to evict
            log.info("trainer: slot %d is empty; no eviction requested", idx)

    # --- commits -------------------------------------------------------------------------------

    async def _publish(self, state: RunState) -> None:
        """Announce the weights of ``state``'s slot as policy version ``progress.step``."""
        await self.publisher.publish(
            state.run_id,
            state.idx,
            state.progress.step,
            self.lora.slot_state_dict(state.idx),
            state.lora_spec,
            base_model_path=self.base_model_path,
            kind=self.kind,
            tenant=state.tenant,
        )

    async def _checkpoint(self, state: RunState) -> None:
        ckpt = state.to_checkpoint(self.lora)
        with self._tracer.start_as_current_span("checkpoint", attributes={"step": ckpt.step}):
            await asyncio.to_thread(
                save_checkpoint, self.output_dir, state.run_id, ckpt, state.config.ckpt.keep
            )
        state.committed_step = ckpt.step
        crash_point("trainer.checkpoint", state.run_id, ckpt.step - 1)
        trained = self._trained.get(state.run_id, [])
        await asyncio.to_thread(
            append_step_log,
            self.output_dir,
            state.run_id,
            [t.record for t in trained if t.step < ckpt.step],
        )

    async def _ack_committed(self, run_id: str) -> None:
        newest: Delivery | None = None
        for trained in self._trained.pop(run_id, []):
            for delivery in trained.deliveries:
                await delivery.ack()
                if newest is None or delivery.stream_sequence > newest.stream_sequence:
                    newest = delivery
        if newest is not None and not self._keep_history:
            # The run's batches before the newest committed one will never be read again:
            # freeing them lets PLEXRL_ROLLOUTS_MAX_BYTES bound the backlog, not the history.
            # Only what every consumer acknowledged goes (a batch trained out of order may still
            # wait for its checkpoint); the newest stays, the witness a restarted orchestrator
            # resumes after.
            # Abandoned at a reconnect, not waited out: the next commit purges the same batches.
            await purge_consumed(
                self.bus.js,
                ROLLOUTS_STREAM,
                newest.msg.subject,
                newest.stream_sequence,
                lost=self.bus.reconnects.lost,
            )

    async def flush(self, state: RunState) -> None:
        """Checkpoint ``state`` if it holds uncommitted steps, then ack them (a clean stop)."""
        if self._trained.get(state.run_id):
            await self._checkpoint(state)
            await self._ack_committed(state.run_id)

    async def attach(self, held: Held) -> None:
        """A redelivery of a step trained but not yet committed: ack it with that step."""
        for trained in self._trained.get(held.batch.run_id, []):
            if trained.step == held.batch.step:
                # A redelivery of the same message replaces its older delivery.
                seq = held.delivery.stream_sequence
                others = [d for d in trained.deliveries if d.stream_sequence != seq]
                trained.deliveries = [*others, held.delivery]
                return
        log.warning(
            "trainer: %s step %d is trained but not tracked; acking its redelivery",
            held.batch.run_id,
            held.batch.step,
        )
        await held.delivery.ack()

    def deliveries(self) -> Iterator[Delivery]:
        """Every delivery awaiting a checkpoint (the heartbeat keeps them alive)."""
        for trained in self._trained.values():
            for t in trained:
                yield from t.deliveries

    async def forget(self, run_id: str) -> None:
        """The run was deleted: its uncommitted batches will never be needed again."""
        await self._ack_committed(run_id)

    # --- after a (re)start ---------------------------------------------------------------------

    async def resume(self, state: RunState) -> None:
        """Make the outside world agree with the state a run was created with: repair the step
        log, rewrite progress and re-announce the checkpoint's adapter version."""
        if state.resumed_from is not None:
            recovered = await asyncio.to_thread(
                recover_step_log, self.output_dir, state.run_id, state.committed_step
            )
            if recovered:
                log.info("trainer: %s: step log recovered steps %s", state.run_id, recovered)
        await write_progress(self.bus, state.run_id, state.progress)
        if state.progress.step > 0:
            await self._publish(state)
        log.info(
            "trainer: %s on slot %d %s at step %d",
            state.run_id,
            state.idx,
            "resumed" if state.resumed_from is not None else "starts",
            state.progress.step,
        )


def _queue_wait(held: Held, start_ns: int) -> float | None:
    """Seconds from the batch being stored on the stream to the start of the step that trained
    it (None for a message without JetStream metadata)."""
    try:
        stored = held.delivery.msg.metadata.timestamp
    except (AttributeError, ValueError, IndexError):
        return None
    return start_ns / 1e9 - stored.timestamp()


def _record(state: RunState, result: RunResult, held: Held, kind: str) -> dict[str, Any]:
    """One line of the step log: what was trained, from which message, with what outcome."""
    stats = result.stats
    return {
        "run_id": state.run_id,
        "weights": kind,
        "step": result.step,
        "policy_version": result.step + 1,
        "stream_seq": held.delivery.stream_sequence,
        "delivered": held.delivery.num_delivered,
        "batch_policy_version": held.batch.policy_version,
        "samples": result.num_samples,
        "tokens": result.num_tokens,
        "loss_tokens": stats.num_tokens,
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "reward_mean": result.reward_mean,
        "clipped_fraction": stats.clipped_fraction,
        "ratio_mean": stats.ratio_mean,
        "ratio_max": stats.ratio_max,
        "kl_mean": stats.kl_mean,
        "pid": os.getpid(),
        "time": time.time(),
    }
