"""The trainer service: many runs' LoRA adapters on one base model, trained step by step.

Every rank follows the registry with a :class:`RunMirror`; its creation hook makes a run's state
(slot reset or checkpoint loaded, AdamW, schedule) and its deletion hook drops it. The loop, on
every rank, in lockstep:

1. ``mirror.synchronize_state()``: apply the lifecycle events that arrived, the same on every
   rank (rank 0 picks the point);
2. stop if any rank was asked to;
3. rank 0 takes from the intake every run's next batch that is available, waiting
   ``collect_ms`` for stragglers once one is there but never for a slow run, and broadcasts them;
4. one multi-run step (:class:`StepExecutor`) in a worker thread, so the event loop keeps the
   held batches alive and the connection served meanwhile;
5. every rank applies the results to its run states; rank 0 commits, announces and acks
   (:class:`Committer`) and asks for the eviction of runs whose step was refused.

A trainer step trains each run at most one step, and only runs whose next batch is there.

With ``full_weights`` the trainer serves one run and trains the model's own parameters instead
of adapters (:class:`~services.model.full.FullWeights`): the same loop, one slot, and the whole
model checkpointed and announced (``WeightsReady.kind = "full"``) after each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from schemas.events import RolloutBatch
from schemas.subjects import ROLLOUTS_STREAM, ROLLOUTS_WILDCARD
from services.bus import Bus, Consumer
from services.model.full import FullWeights
from services.model.lora import MultiLoRA
from services.runs.mirror import RunMirror
from services.trainer.checkpoint import latest_checkpoint, remove_partials
from services.trainer.checkpoint_files import CheckpointFiles
from services.trainer.command_inbox import CommandInbox
from services.trainer.commands import CommandRunner
from services.trainer.commit import Committer
from services.trainer.distributed import SINGLE, Ranks
from services.trainer.intake import Held, Intake, RunSteps
from services.trainer.settings import TrainerSettings
from services.trainer.slots import WeightSlots
from services.trainer.state import RunSetupError, RunState, create_run_state
from services.trainer.step import StepExecutor, StepReport
from services.weights import WeightPublisher
from services.weights.errors import TransportUnavailable
from services.weights.transport import unavailable_reason

log = logging.getLogger(__name__)

IDLE_WAIT = 0.2
"""seconds rank 0 waits for a batch before going back to the step boundary (new run events)"""


class Trainer:
    """One trainer rank. Rank 0 also consumes, commits and publishes."""

    def __init__(
        self,
        settings: TrainerSettings,
        bus: Bus,
        model: Any,
        lora: WeightSlots,
        *,
        pad_id: int,
        vocab_size: int,
        ranks: Ranks = SINGLE,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.lora = lora
        self.ranks = ranks
        self.device = torch.device(
            f"cuda:{ranks.local_rank}" if settings.device == "cuda" else "cpu"
        )
        self.executor = StepExecutor(
            model,
            lora,
            token_budget=settings.micro_batch_tokens,
            pad_id=pad_id,
            vocab_size=vocab_size,
            device=self.device,
            ranks=ranks,
        )
        self.mirror = RunMirror(
            bus,
            settings.max_runs,
            service=settings.service,
            broadcast=ranks.broadcast_object if ranks.distributed else None,
        )
        self.mirror.register_deletion_hook(self._on_delete)
        self.mirror.register_creation_hook(self._on_create)
        self.states: dict[int, RunState] = {}
        self.refused: dict[str, str] = {}
        """runs the trainer cannot serve (run id -> reason), until the registry evicts them"""
        self.num_steps = 0
        """trainer steps taken (each trains one step of one or more runs)"""
        self._after_sync: list[Any] = []
        self._in_flight: list[Held] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._pump: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        # One worker thread for every step: the CUDA device is per thread, and collectives of
        # one process group must not run from two threads at once.
        self._pool = ThreadPoolExecutor(1, "trainer-step", initializer=self._init_worker)
        self.intake: Intake | None = None
        self.committer: Committer | None = None
        self.publisher: WeightPublisher | None = None
        self.inbox: CommandInbox | None = None
        if ranks.is_main:
            consumer: Consumer[RolloutBatch] = Consumer(
                bus,
                stream=ROLLOUTS_STREAM,
                durable=settings.consumer_name,
                filter_subject=ROLLOUTS_WILDCARD,
                event_type=RolloutBatch,
                ack_wait=settings.ack_wait,
                max_ack_pending=100_000,
            )
            self.intake = Intake(
                bus,
                consumer,
                unknown_run_hold=settings.unknown_run_hold,
                tenant_of=self.mirror.tenant_of,
            )
            self.publisher = build_publisher(settings, bus)
            self.committer = Committer(
                bus,
                lora,
                self.mirror,
                self.publisher,
                settings.output_dir,
                base_model_path=str(settings.model),
            )
            self.inbox = CommandInbox(
                bus,
                wake=self.intake.arrived.set,
                checkpoints=CheckpointFiles(bus, settings.output_dir),
            )
            # what a reconnect lost (a batch in flight, acks a killed server forgot) comes
            # back at once, not when ack_wait runs out
            consumer.recover_on_reconnect()
        self.commands = CommandRunner(
            model,
            lora,
            self._pool,
            token_budget=settings.micro_batch_tokens,
            pad_id=pad_id,
            vocab_size=vocab_size,
            device=self.device,
            output_dir=settings.output_dir,
            ranks=ranks,
            bus=bus if ranks.is_main else None,
            publisher=self.publisher,
            base_model_path=str(settings.model),
        )

    def _init_worker(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    # --- lifecycle hooks (every rank, inside synchronize_state) ---------------------------------

    def _on_create(self, idx: int, run_id: str) -> None:
        info = self.mirror.runs[idx]
        checkpoint = None
        if self.ranks.is_main:
            remove_partials(self.settings.output_dir, run_id)
            checkpoint = latest_checkpoint(self.settings.output_dir, run_id)
        # Only rank 0 reads the output directory; the other ranks need not share it.
        checkpoint = self.ranks.broadcast_object(checkpoint)
        try:
            state = create_run_state(
                self.lora,
                idx,
                run_id,
                info.config,
                info.config_digest,
                checkpoint,
                tenant=info.tenant,
            )
        except (RunSetupError, ValueError) as exc:
            log.error("trainer: cannot serve %s: %s", run_id, exc)
            self.refused[run_id] = str(exc)
            if self.committer is not None:
                self._after_sync.append(self.committer.evict(idx, str(exc)))
            return
        self.states[idx] = state
        if self.intake is not None and self.committer is not None:
            self.intake.removed.discard(run_id)
            self._after_sync.append(self.committer.resume(state))

    def _on_delete(self, idx: int, run_id: str) -> None:
        self.refused.pop(run_id, None)
        state = self.states.pop(idx, None)
        if state is not None:
            for p in self.lora.slot_parameters(idx):
                p.grad = None
        self.commands.forget(run_id)
        if self.intake is not None and self.committer is not None:
            self.intake.removed.add(run_id)
            self._after_sync.append(self.committer.forget(run_id))
        log.info("trainer: %s left slot %d", run_id, idx)

    # --- running --------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.publisher is not None:
            # A weight transport that cannot run (a UCX port taken) fails here, not at step 1.
            await self.publisher.start()
        await self.mirror.start()
        await self.mirror.wait_until_caught_up(timeout=30.0)
        if self.intake is not None:
            # The one consumer of the rollouts: what a killed predecessor held comes back now,
            # not when its ack_wait runs out.
            await self.intake.consumer.take_over()
            self._pump = asyncio.create_task(self.intake.pump(self._closing))
            self._tasks.append(asyncio.create_task(self._heartbeat()))
        if self.inbox is not None:
            await self.inbox.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Train until ``stop`` is set (on any rank), then shut down cleanly."""
        await self.start()
        try:
            while await self.iteration(stop):
                pass
        finally:
            await self.close()

    async def iteration(self, stop: asyncio.Event) -> bool:
        """One step boundary and, if any batch is ready, one trainer step; False to stop."""
        await self.mirror.synchronize_state()
        await self._run_after_sync()
        if self.ranks.any(stop.is_set(), self.device):
            return False
        await self._execute_commands()
        held = await self._collect() if self.intake is not None else {}
        work = [(slot, h.batch) for slot, h in sorted(held.items())]
        work = self.ranks.broadcast_object(work)
        if not work:
            return True
        self._in_flight = list(held.values())
        loop = asyncio.get_running_loop()
        report = await loop.run_in_executor(self._pool, self.executor.run, work, self.states)
        self.num_steps += 1
        self._apply(report)
        if self.committer is not None:
            await self._commit(report, held)
        self._in_flight = []
        return True

    async def close(self) -> None:
        """Commit what was trained, hand back what was not, unsubscribe; idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self.inbox is not None:
            await self.inbox.stop()
        if self._pump is not None:
            # Let the last fetch end rather than cancel it: a message the server hands to a
            # pull request nobody reads any more would sit unacked until ack_wait runs out.
            await asyncio.gather(self._pump, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self.committer is not None:
            for state in list(self.states.values()):
                await self.committer.flush(state)
        if self.intake is not None:
            await self.intake.release()
            await self.intake.consumer.close()
        await self.mirror.stop()
        if self.publisher is not None:
            await self.publisher.close()
        self._pool.shutdown(wait=True)

    # --- inside a step boundary -----------------------------------------------------------------

    async def _run_after_sync(self) -> None:
        pending, self._after_sync = self._after_sync, []
        for work in pending:
            await work

    async def _execute_commands(self) -> None:
        """Every rank: the training commands that arrived, applied between two steps.

        Rank 0 waits ``collect_ms`` once a command is there, so the forward_backward requests
        that several clients send together share one pass."""
        taken = []
        if self.inbox is not None and self.inbox.pending():
            if self.settings.collect_ms > 0:
                await asyncio.sleep(self.settings.collect_ms / 1000)
            taken = self.inbox.take()
        commands = self.ranks.broadcast_object([command for command, _ in taken])
        if not commands:
            return
        results = await self.commands.execute(commands, self.states)
        if self.inbox is not None:
            await self.inbox.answer(taken, results)

    def _views(self) -> dict[str, RunSteps]:
        # A commands run takes no RolloutBatch: one sent for it is dropped like an evicted run's.
        views = {
            s.run_id: RunSteps(
                s.next_step,
                s.committed_step,
                s.evicting is not None or s.config.driver == "commands",
                max_lag=s.config.max_async_level,
            )
            for s in self.states.values()
        }
        views.update({run_id: RunSteps(0, 0, evicting=True) for run_id in self.refused})
        return views

    async def _collect(self) -> dict[int, Held]:
        """Rank 0: every run's next batch that is here now (after a short wait for more)."""
        assert self.intake is not None and self.committer is not None
        intake, views = self.intake, self._views()
        if not intake.has_trainable(views) and not (self.inbox and self.inbox.pending()):
            intake.arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(intake.arrived.wait(), IDLE_WAIT)
        selection = await intake.select(views)
        active = sum(not v.evicting for v in views.values())
        if selection.train and self.settings.collect_ms > 0 and len(selection.train) < active:
            await asyncio.sleep(self.settings.collect_ms / 1000)
            more = await intake.select(views, skip=selection.train.keys())
            selection.train.update(more.train)
            selection.uncommitted.extend(more.uncommitted)
        for held in selection.uncommitted:
            await self.committer.attach(held)
        slot_of = {s.run_id: idx for idx, s in self.states.items()}
        return {slot_of[run_id]: held for run_id, held in selection.train.items()}

    def _apply(self, report: StepReport) -> None:
        for slot, result in report.runs.items():
            state = self.states[slot]
            if result.trained:
                state.advance(result.num_tokens, result.num_samples, result.reward_mean)
            else:
                state.evicting = result.reason

    async def _commit(self, report: StepReport, held: dict[int, Held]) -> None:
        assert self.committer is not None
        for slot, result in report.runs.items():
            state = self.states[slot]
            if result.trained:
                await self.committer.finish(state, result, held[slot], report.phases)
            else:
                await self.committer.refuse(state, result, held[slot])

    async def _heartbeat(self) -> None:
        """Keep every held, in-flight and uncommitted batch from being redelivered."""
        assert self.intake is not None and self.committer is not None
        period = min(max(self.settings.ack_wait / 3, 0.2), 30.0)
        while not self._closing.is_set():
            await asyncio.sleep(period)
            others = [h.delivery for h in self._in_flight]
            await self.intake.keep_alive([*others, *self.committer.deliveries()])


# --- assembling a trainer ---------------------------------------------------------------------


def build_publisher(settings: TrainerSettings, bus: Bus) -> WeightPublisher:
    """The weight publisher of ``settings.weight_transport``, with its transport's sender.

    Whether the transport can run here is checked first (``plexrl trainer`` checks it before
    connecting); an unusable one raises :class:`TransportUnavailable` with the reason.
    """
    transport = settings.weight_transport
    reason = unavailable_reason(transport)
    if reason is not None:
        raise TransportUnavailable(reason)
    from services.weights import SenderOptions

    return WeightPublisher(
        bus,
        settings.output_dir,
        transport=transport,
        keep_last=settings.keep_weights,
        options=SenderOptions(
            ucx_host=settings.ucx_host,
            ucx_port=settings.ucx_port,
            collective_host=settings.collective_host,
            collective_port=settings.collective_port,
            collective_bucket_bytes=settings.collective_bucket_bytes,
        ),
    )


def build_model(
    settings: TrainerSettings, device: torch.device, ranks: Ranks = SINGLE
) -> tuple[Any, WeightSlots, int, int]:
    """``(model, slots, pad_id, vocab_size)``: the base model with ``max_runs`` adapter slots,
    or, with ``full_weights``, with its own parameters as the one slot. On sharded ranks
    (``ranks.lockstep``) the model is loaded straight into its shards
    (:mod:`services.trainer.sharded_load`).

    ``vocab_size`` is the embedding's size, the bound the packer checks token ids against (a
    tokenizer may know fewer tokens, never more); the pad id comes from the tokenizer, else the
    model config, else 0 (padding is masked out of every loss, so any valid id does).
    """
    from services.model.loader import load_model

    slots: WeightSlots
    if ranks.lockstep and not settings.full_weights:
        from services.trainer.sharded_load import load_sharded

        model, slots, tokenizer = load_sharded(settings, device, ranks)
        return _with_ids(model, slots, tokenizer)
    dtype = torch.bfloat16 if settings.dtype == "bfloat16" else torch.float32
    model, tokenizer = load_model(settings.model, device=device, dtype=dtype)
    if settings.full_weights:
        slots = FullWeights.attach(model, settings.model)
    else:
        slots = MultiLoRA.attach(
            model,
            n_adapters=settings.max_runs,
            max_rank=settings.max_lora_rank,
            target_modules=settings.target_modules,
        )
    return _with_ids(model, slots, tokenizer)


def _with_ids(model: Any, slots: WeightSlots, tokenizer: Any) -> tuple[Any, WeightSlots, int, int]:
    vocab_size = int(model.get_input_embeddings().num_embeddings)
    pad_id = getattr(tokenizer, "pad_token_id", None)
    if pad_id is None:
        pad_id = getattr(model.config, "pad_token_id", None)
    return model, slots, int(pad_id or 0), vocab_size


async def serve(settings: TrainerSettings, bus: Bus, stop: asyncio.Event, ranks: Ranks) -> None:
    """Load the model and train until ``stop``; what ``plexrl trainer`` runs once connected."""
    device = torch.device(f"cuda:{ranks.local_rank}" if settings.device == "cuda" else "cpu")
    model, lora, pad_id, vocab_size = await asyncio.to_thread(build_model, settings, device, ranks)
    trainer = Trainer(settings, bus, model, lora, pad_id=pad_id, vocab_size=vocab_size, ranks=ranks)
    what = (
        "the full weights, for one run,"
        if settings.full_weights
        else f"{settings.max_runs} slots (max rank {settings.max_lora_rank})"
    )
    log.info(
        "trainer: rank %d/%d training %s of %s on %s%s",
        ranks.rank,
        ranks.world_size,
        what,
        settings.model,
        device,
        f", {ranks.sharding}-sharded" if ranks.lockstep else "",
    )
    await trainer.run(stop)
