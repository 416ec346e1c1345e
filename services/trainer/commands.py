"""Training commands: the trainer's request/reply path beside the RolloutBatch path.

A run submitted with ``driver = "commands"`` is trained by explicit commands
(``schemas/training.py``): ``forward_backward`` adds the gradients of a caller-supplied loss to
the run's slot, ``optim_step`` applies them with the request's Adam parameters, and
``save_weights`` / ``load_weights`` publish, checkpoint and restore the adapter. The HTTP
gateway turns the Tinker API into these commands; any NATS client may send them.

- :class:`~services.trainer.command_inbox.CommandInbox` (rank 0) subscribes to
  ``plexrl.train.>``, decodes each request, answers what does not decode at once, and queues
  the rest; the trainer takes the queue at its next step boundary, so commands never run while
  a RolloutBatch step is using the model.
- :class:`CommandRunner` (every rank, the same commands broadcast from rank 0) executes them. A
  run's commands apply in the order they arrived; the ``forward_backward`` requests of different
  runs waiting together go through the model in shared micro-batches (one pass, each run's rows
  routed to its own slot). Each run keeps its recent results by ``request_id``: a retried request
  gets the stored result and is not applied again.

Checks, each answered with the result's ``error`` and nothing applied: the run must be known
here, belong to the requester's tenant (the subject's tenant, which the broker vouches for; the
services' own default tenant may act for any run), and be a commands run; the data must fit the
loss (see :mod:`services.trainer.supervised`).

After ``optim_step`` the run's progress goes to ``plexrl-progress``; when the run's
``ckpt.interval`` asks for it, a checkpoint is written, which a restarted trainer resumes from.
Commands runs write no ``trainer_steps.jsonl``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace

from schemas.tenant import DEFAULT_TENANT
from schemas.training import (
    TRAIN_COMMANDS,
    ForwardBackwardRequest,
    ForwardBackwardResult,
    LoadWeightsRequest,
    LoadWeightsResult,
    OptimStepRequest,
    OptimStepResult,
    SaveWeightsRequest,
    SaveWeightsResult,
    TrainResult,
)
from services.bus import Bus, tracing
from services.runs.progress import write_progress
from services.runs.table import read_record
from services.telemetry.metrics import record_trainer_step
from services.trainer.checkpoint import MARKER, checkpoints_dir, load_checkpoint, save_checkpoint
from services.trainer.checkpoint_files import record_sampler_save
from services.trainer.command_inbox import Command, failure, wrong_tenant
from services.trainer.distributed import SINGLE, Ranks
from services.trainer.sharding import same_pass_grad_scale
from services.trainer.slots import WeightSlots
from services.trainer.state import RunSetupError, RunState, restore_checkpoint
from services.trainer.supervised import CommandError, FbOutcome, check_request, forward_backward
from services.weights import WeightPublisher

log = logging.getLogger(__name__)

KEEP_RESULTS = 1024
"""results remembered per run for retried request ids"""


# --- every rank: executing --------------------------------------------------------------------


class CommandRunner:
    """Executes commands against the trainer's run states; the same on every rank."""

    def __init__(
        self,
        model: Any,
        lora: WeightSlots,
        pool: Executor,
        *,
        token_budget: int,
        pad_id: int,
        vocab_size: int,
        device: torch.device,
        output_dir: Path,
        ranks: Ranks = SINGLE,
        bus: Bus | None = None,
        publisher: WeightPublisher | None = None,
        base_model_path: str = "",
    ) -> None:
        self.model = model
        self.lora = lora
        self.pool = pool
        self.token_budget = token_budget
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.device = device
        self.output_dir = Path(output_dir)
        self.ranks = ranks
        self.bus = bus
        """rank 0 only, like the publisher: progress, weights and checkpoints are its to write"""
        self.publisher = publisher
        self.base_model_path = base_model_path
        self.shared_passes = 0
        """forward/backward passes that held the requests of more than one run"""
        self._done: dict[str, OrderedDict[str, TrainResult]] = defaultdict(OrderedDict)
        self._accumulated: dict[str, tuple[int, int, int]] = {}
        """run id -> (requests, sequences, tokens) whose gradients wait for an optim_step"""
        self._tracer = trace.get_tracer("plexrl.trainer")

    def forget(self, run_id: str) -> None:
        """The run left: its stored results and pending gradients go with it."""
        self._done.pop(run_id, None)
        self._accumulated.pop(run_id, None)

    async def execute(
        self, commands: list[Command], states: dict[int, RunState]
    ) -> list[TrainResult]:
        """One result per command, in order; see the module docstring for the order applied."""
        by_id = {s.run_id: s for s in states.values()}
        results: list[TrainResult | None] = [None] * len(commands)
        queues: dict[str, deque[int]] = {}
        for i, command in enumerate(commands):
            error = _refusal(command, by_id.get(command.request.run_id))
            if error is not None:
                results[i] = failure(command, error)
            else:
                queues.setdefault(command.request.run_id, deque()).append(i)
        while queues:
            heads = [q.popleft() for q in queues.values()]
            queues = {run: q for run, q in queues.items() if q}
            fresh = []
            for i in heads:
                req = commands[i].request
                stored = self._done[req.run_id].get(req.request_id)
                if stored is not None and isinstance(stored, TRAIN_COMMANDS[commands[i].kind][1]):
                    results[i] = stored
                else:
                    fresh.append(i)
            passes = [i for i in fresh if commands[i].kind == "forward_backward"]
            if passes:
                work = [(by_id[commands[i].request.run_id], commands[i]) for i in passes]
                for i, result in zip(passes, await self._forward_backward(work), strict=True):
                    results[i] = result
            for i in fresh:
                if commands[i].kind != "forward_backward":
                    state = by_id[commands[i].request.run_id]
                    results[i] = await self._one(state, commands[i])
            for i in fresh:
                answered = results[i]
                assert answered is not None
                done = self._done[answered.run_id]
                done[answered.request_id] = answered
                while len(done) > KEEP_RESULTS:
                    done.popitem(last=False)
        return [r for r in results if r is not None]

    async def _forward_backward(self, work: list[tuple[RunState, Command]]) -> list[TrainResult]:
        results: dict[int, TrainResult] = {}
        valid: list[tuple[int, RunState, ForwardBackwardRequest]] = []
        for i, (state, command) in enumerate(work):
            req = command.request
            assert isinstance(req, ForwardBackwardRequest)
            try:
                check_request(req, self.vocab_size)
            except CommandError as exc:
                results[i] = failure(command, str(exc))
                continue
            valid.append((i, state, req))
        if valid:
            started = time.time_ns()
            outcomes = await self._in_pool(
                forward_backward,
                self.model,
                self.lora,
                [(state.idx, req) for _, state, req in valid],
                token_budget=self.token_budget,
                pad_id=self.pad_id,
                device=self.device,
                grad_scale=same_pass_grad_scale(self.lora),
            )
            ended = time.time_ns()
            runs = sorted({s.run_id for _, s, _ in valid})
            for i, state, req in valid:  # one span per request, in the request's own trace
                self._tracer.start_span(
                    "train forward_backward",
                    context=tracing.extract(work[i][1].trace),
                    start_time=started,
                    attributes={
                        "run_id": state.run_id,
                        "request_id": req.request_id,
                        "runs_in_pass": len(runs),
                        "requests_in_pass": len(valid),
                    },
                ).end(end_time=ended)
            if len({s.run_id for _, s, _ in valid}) > 1:
                self.shared_passes += 1
            for (i, state, req), outcome in zip(valid, outcomes, strict=True):
                results[i] = self._fb_result(state, req, outcome)
        return [results[i] for i in range(len(work))]

    def _fb_result(
        self, state: RunState, req: ForwardBackwardRequest, outcome: FbOutcome
    ) -> ForwardBackwardResult:
        if outcome.error is None and not req.forward_only:
            n, seqs, tokens = self._accumulated.get(state.run_id, (0, 0, 0))
            self._accumulated[state.run_id] = (
                n + 1,
                seqs + len(req.data),
                tokens + outcome.num_tokens,
            )
        return ForwardBackwardResult(
            request_id=req.request_id,
            run_id=req.run_id,
            loss_fn_outputs=outcome.outputs,
            metrics={
                "loss:sum": outcome.loss if outcome.error is None else 0.0,
                "tokens:sum": float(outcome.num_tokens),
                "runs_in_pass:max": float(outcome.runs_in_pass),
            },
            step=state.progress.step,
            error=outcome.error,
        )

    async def _one(self, state: RunState, command: Command) -> TrainResult:
        req = command.request
        with self._tracer.start_as_current_span(
            f"train {command.kind}",
            context=tracing.extract(command.trace),
            attributes={"run_id": req.run_id, "request_id": req.request_id},
        ) as span:
            try:
                if isinstance(req, OptimStepRequest):
                    return await self._optim_step(state, req)
                if isinstance(req, SaveWeightsRequest):
                    return await self._save(state, req)
                if isinstance(req, LoadWeightsRequest):
                    return await self._load(state, req)
                raise CommandError(f"unknown command {command.kind}")
            except CommandError as exc:
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                return failure(command, str(exc))
            except Exception as exc:  # a failing command answers its caller, it never kills us
                log.exception("trainer: %s %s failed", command.kind, req.request_id)
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                return failure(command, f"{command.kind} failed: {exc.__class__.__name__}: {exc}")

    async def _optim_step(self, state: RunState, req: OptimStepRequest) -> OptimStepResult:
        start = time.monotonic()
        applied, sequences, tokens = self._accumulated.pop(state.run_id, (0, 0, 0))
        grad_norm, lr = await self._in_pool(_adam_step, self.lora, state, req)
        state.advance(tokens, sequences, None)
        if self.bus is not None:
            record_trainer_step(
                state.run_id,
                tenant=state.tenant,
                seconds=time.monotonic() - start,
                tokens=tokens,
                samples=sequences,
                queue_wait=None,
            )
            await write_progress(self.bus, state.run_id, state.progress)
            if state.checkpoint_due():
                await self._checkpoint(state, None)
        return OptimStepResult(
            request_id=req.request_id,
            run_id=req.run_id,
            step=state.progress.step,
            metrics={"grad_norm": grad_norm, "learning_rate": lr, "applied": float(applied)},
        )

    async def _save(self, state: RunState, req: SaveWeightsRequest) -> SaveWeightsResult:
        step = state.progress.step
        if req.kind == "sampler":
            if self.publisher is not None:
                await self.publisher.publish(
                    state.run_id,
                    state.idx,
                    step,
                    self.lora.slot_state_dict(state.idx),
                    state.lora_spec,
                    base_model_path=self.base_model_path,
                    kind=self.lora.kind,
                    tenant=state.tenant,
                )
            path = f"{state.run_id}@{step}"
            if self.bus is not None and req.name:
                await asyncio.to_thread(
                    record_sampler_save, self.output_dir, state.run_id, req.name, step
                )
        else:
            if req.name.startswith(("step_", ".")):
                raise CommandError(
                    f"checkpoint name {req.name!r} is reserved (step_<n> names the run's own "
                    "checkpoints, a leading '.' a partial one); choose another, or leave it empty"
                )
            taken = checkpoints_dir(self.output_dir, state.run_id) / req.name
            if req.name and not req.overwrite and self.ranks.is_main and (taken / MARKER).is_file():
                raise CommandError(
                    f"{state.run_id} already has a checkpoint named {req.name!r}; choose another "
                    "name, or save with overwrite to replace it"
                )
            path = await self._checkpoint(state, req.name or None)
        return SaveWeightsResult(
            request_id=req.request_id, run_id=req.run_id, kind=req.kind, step=step, path=path
        )

    async def _checkpoint(self, state: RunState, name: str | None) -> str:
        """Rank 0 writes the checkpoint; every rank learns its name."""
        written = ""
        if self.bus is not None:
            ckpt = state.to_checkpoint(self.lora)
            path = await asyncio.to_thread(
                save_checkpoint,
                self.output_dir,
                state.run_id,
                ckpt,
                state.config.ckpt.keep,
                name=name,
            )
            written = path.name
        if name is None:
            state.committed_step = state.progress.step
        return written or f"step_{state.progress.step}"

    async def _load(self, state: RunState, req: LoadWeightsRequest) -> LoadWeightsResult:
        ckpt = None
        error = None
        if self.ranks.is_main:
            source = req.source_run_id or state.run_id
            path = checkpoints_dir(self.output_dir, source) / req.path
            if source != state.run_id and not await self._same_tenant(source, state.tenant):
                error = f"unknown run {source}"
            elif req.path.startswith(".") or not (path / MARKER).is_file():
                error = (
                    f"{source} has no complete checkpoint named {req.path!r}; name one "
                    "that save_weights (kind 'state') answered with"
                )
            else:
                ckpt = await asyncio.to_thread(load_checkpoint, path)
        ckpt, error = self.ranks.broadcast_object((ckpt, error))
        if error is not None:
            raise CommandError(error)
        try:
            restore_checkpoint(self.lora, state, ckpt, optimizer=req.optimizer)
        except RunSetupError as exc:
            raise CommandError(str(exc)) from None
        for p in self.lora.slot_parameters(state.idx):
            p.grad = None
        self._accumulated.pop(state.run_id, None)
        if self.bus is not None:
            await write_progress(self.bus, state.run_id, state.progress)
        return LoadWeightsResult(
            request_id=req.request_id, run_id=req.run_id, step=state.progress.step
        )

    async def _same_tenant(self, run_id: str, tenant: str) -> bool:
        """Whether the run table holds ``run_id`` (in any status) as ``tenant``'s."""
        if self.bus is None:
            return False
        record = await read_record(self.bus, run_id)
        return record is not None and record.tenant == tenant

    async def _in_pool(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, lambda: fn(*args, **kwargs))


def _refusal(command: Command, state: RunState | None) -> str | None:
    """Why ``command`` may not touch ``state``'s run, or None."""
    run_id = command.request.run_id
    if state is None:
        return (
            f"unknown run {run_id}: no run with this id trains here (submit it with "
            "driver = 'commands' and wait for it to be discovered, or check it was not evicted)"
        )
    if command.tenant != DEFAULT_TENANT and state.tenant != command.tenant:
        return wrong_tenant(command)
    if state.config.driver != "commands":
        return (
            f"{run_id} is trained from RolloutBatch events (driver = '{state.config.driver}'); "
            "training commands apply only to runs submitted with driver = 'commands'"
        )
    if state.evicting is not None:
        return f"{run_id} is being evicted: {state.evicting}"
    return None


def _adam_step(lora: WeightSlots, state: RunState, req: OptimStepRequest) -> tuple[float, float]:
    """Apply the accumulated gradients with ``req.adam_params``: (grad norm, learning rate)."""
    adam = req.adam_params
    params = lora.slot_parameters(state.idx)
    for group in state.optimizer.param_groups:
        group.update(
            lr=adam.learning_rate,
            betas=(adam.beta1, adam.beta2),
            eps=adam.eps,
            weight_decay=adam.weight_decay,
        )
    max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if not math.isfinite(grad_norm):
        for p in params:
            p.grad = None
        raise CommandError(
            f"non-finite gradient norm ({grad_norm}); the gradients were dropped and the "
            "adapter is unchanged"
        )
    state.optimizer.step()
    for p in params:
        p.grad = None
    return grad_norm, adam.learning_rate
