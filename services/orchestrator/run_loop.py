"""The orchestrator of one run: prompts in, RolloutBatch out, never too far ahead of training.

:meth:`RunOrchestrator.run` does, in order:

1. **admission** (:mod:`.lifecycle`): submit the run unless the registry holds it, then wait for
   its RunDiscovered; a rejection ends the run with status ``rejected`` (exit 2);
2. **resume** (:mod:`.state`): the first step is the furthest of the orchestrator's checkpoint,
   the trainer's progress and the newest batch on the stream;
3. **the loop**, for each step ``n`` up to ``max_steps - 1``:

   - wait until the trainer has announced policy version ``n - max_async_level``
     (:mod:`.versions`); ``max_async_level = 0`` makes the run synchronous, 1 lets step
     ``n + 1`` be generated while the trainer trains on step ``n``;
   - ask inference for ``group_size`` completions of each of the step's ``batch_size`` prompts,
     all requests at once, each demanding that version (:mod:`.client`, :mod:`.rollouts`);
   - score, compute group-relative advantages (dropping and replacing groups without reward
     spread under ``advantage.dynamic_sampling``, :mod:`.dynamic_sampling`), publish the
     RolloutBatch with message id ``<run_id>/step_<n>``, append a line to ``metrics.jsonl``
     (:mod:`.metrics`) and checkpoint (:mod:`.step`);
   - every ``eval.interval`` steps, evaluate the policy on the held-out prompts and add the
     result to the step's metrics line (:mod:`.evaluation`); the base model is evaluated once,
     before the first step;

4. **the end**: once every step is published, wait (unless told not to) until the trainer has
   announced version ``max_steps``, so whoever started the run knows training is over, then
   evaluate that final policy and add it to the last step's line.

Throughout, a RunEvicted or RunForgotten for the run cancels whatever is in flight and ends the
run with status ``evicted`` (exit 3). Setting ``stop`` (SIGTERM) ends it cleanly: a step being
generated is finished, published and checkpointed, then ``run`` returns ``stopped`` (exit 0).

Each step is one trace: the span "orchestrator step" (attributes ``run_id``, ``step``,
``policy_version``) is the parent of the generate requests, the "score" span and the publish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

from schemas.config import OrchConfig
from schemas.events import RunEvicted, RunForgotten
from schemas.run_id import validate_run_id
from services.bus import Bus, PayloadTooLarge
from services.envs import Environment, EnvLoadError, SplitError, load_environment
from services.orchestrator import rollouts
from services.orchestrator.client import GenerateClient, GenerationError, GenerationStopped
from services.orchestrator.dynamic_sampling import FilteringStepRunner
from services.orchestrator.evaluation import (
    BaseEval,
    EvalUnavailable,
    HeldOutEvaluator,
    eval_due,
    fields_of,
)
from services.orchestrator.lifecycle import (
    Admission,
    RunRejected,
    RunRemoved,
    RunWatch,
    admit,
    removal_reason,
)
from services.orchestrator.metrics import (
    append_metrics,
    merge_metrics,
    metrics_path,
    recorded_steps,
    recovered_metrics,
)
from services.orchestrator.state import (
    CheckpointError,
    checkpoint_path,
    last_published_batch,
    read_checkpoint,
    read_progress,
    resume_step,
)
from services.orchestrator.step import ScoringError, StepRunner
from services.orchestrator.versions import PolicyVersions

log = logging.getLogger(__name__)
T = TypeVar("T")

Status = Literal["done", "stopped", "evicted", "rejected", "failed"]
EXIT_CODES: dict[Status, int] = {"done": 0, "stopped": 0, "rejected": 2, "evicted": 3, "failed": 1}


@dataclass(frozen=True)
class OrchestratorResult:
    """How a run's orchestrator ended."""

    run_id: str
    status: Status
    next_step: int
    """the first step not published (``max_steps`` when all were)"""
    steps_published: int
    """steps this call published (a resumed run counts only its own)"""
    policy_version: int
    """the newest policy version the trainer had announced"""
    reason: str = ""

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.status]


class _Stopped(Exception):
    """``stop`` was set while the loop waited."""


class RunOrchestrator:
    """Drives one run; see the module docstring. Several can share one bus and event loop."""

    def __init__(
        self,
        bus: Bus,
        run_id: str,
        config: OrchConfig,
        *,
        output_dir: Path | str,
        tokenizer: Any,
        env: Environment | None = None,
        request_timeout: float = 120.0,
        progress_every_s: float = 2.0,
        wait_for_training: bool = True,
        max_concurrent_requests: int = 64,
        submitted_by: str = "plexrl orchestrator",
        registry_service: str = "registry",
    ) -> None:
        self.bus = bus
        self.run_id = validate_run_id(run_id)
        self.config = config
        self.output_dir = Path(output_dir)
        self.tokenizer = tokenizer
        # Loading the environment here makes a bad ``env`` a constructor error (exit 2 in the
        # CLI) instead of a failure after the run was submitted.
        self.env = env or load_environment(config.env, config.seed, **config.env_args)
        try:
            self.env.train_prompt(0)
        except SplitError as exc:
            raise EnvLoadError(str(exc)) from exc
        self.evaluate = config.eval.interval > 0
        if self.evaluate:
            try:
                self.env.heldout_prompts(config.eval.num_prompts)
            except SplitError as exc:
                log.warning("%s: no held-out evaluation: %s", run_id, exc)
                self.evaluate = False
        self.request_timeout = request_timeout
        self.progress_every_s = progress_every_s
        self.wait_for_training = wait_for_training
        self.submitted_by = submitted_by
        self.registry_service = registry_service
        self.max_concurrent_requests = max_concurrent_requests
        self._versions: PolicyVersions | None = None
        self._steps: StepRunner | None = None
        self._evaluator: HeldOutEvaluator | None = None
        self._base: BaseEval | None = None
        self.next_step = 0
        self.steps_published = 0

    @property
    def checkpoint_path(self) -> Path:
        return checkpoint_path(self.output_dir, self.run_id)

    @property
    def metrics_path(self) -> Path:
        return metrics_path(self.output_dir, self.run_id)

    def _result(self, status: Status, reason: str = "") -> OrchestratorResult:
        version = self._versions.latest if self._versions is not None else 0
        return OrchestratorResult(
            self.run_id, status, self.next_step, self.steps_published, version, reason
        )

    # --- the run ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> OrchestratorResult:
        """Admit, resume and drive the run until it is done, stopped, evicted or fails."""
        watch = RunWatch(self.bus, self.run_id)
        try:
            await watch.start()
            admission = await admit(
                self.bus,
                watch,
                self.config,
                submitted_by=self.submitted_by,
                stop=stop,
                registry_service=self.registry_service,
            )
            if admission is None:
                return self._result("stopped", "stopped before the run was discovered")
            log.info("%s: discovered with index %d", self.run_id, admission.idx)
            self._versions = PolicyVersions(self.bus, self.run_id, since=admission.incarnation_time)
            await self._versions.start()
            self.next_step = await self._resume_step(admission)
            client = GenerateClient(
                self.bus,
                timeout=self.request_timeout,
                stop=stop,
                progress_every_s=self.progress_every_s,
            )
            self._steps = FilteringStepRunner(
                self.bus,
                self.run_id,
                self.config,
                env=self.env,
                tokenizer=self.tokenizer,
                client=client,
                output_dir=self.output_dir,
                incarnation=admission.incarnation_seq,
                max_concurrent_requests=self.max_concurrent_requests,
            )
            if self.evaluate:
                self._evaluator = HeldOutEvaluator(
                    self.run_id,
                    self.config,
                    env=self.env,
                    tokenizer=self.tokenizer,
                    client=client,
                    output_dir=self.output_dir,
                    max_concurrent_requests=self.max_concurrent_requests,
                )
            return await self._until_removed(watch, admission, self._drive(stop))
        except RunRejected as exc:
            return self._result("rejected", str(exc))
        except RunRemoved as exc:
            return self._result("evicted", exc.reason)
        except (
            GenerationError,
            rollouts.BadResponse,
            ScoringError,
            CheckpointError,
            PayloadTooLarge,
        ) as exc:
            log.error("%s: %s", self.run_id, exc)
            return self._result("failed", str(exc))
        finally:
            if self._versions is not None:
                await self._versions.stop()
            await watch.stop()

    async def _until_removed(
        self, watch: RunWatch, admission: Admission, work: Awaitable[OrchestratorResult]
    ) -> OrchestratorResult:
        """``work``'s result, unless the run is evicted or forgotten first (then cancel it)."""
        since = admission.incarnation_seq
        finished, result = await _race(
            work, watch.wait(lambda: watch.removal_after(since) is not None)
        )
        if finished:
            assert result is not None
            return result
        entry = watch.removal_after(since)
        assert entry is not None and isinstance(entry.event, RunEvicted | RunForgotten)
        reason = removal_reason(entry.event)
        log.warning("%s evicted: %s", self.run_id, reason)
        return self._result("evicted", reason)

    async def _resume_step(self, admission: Admission) -> int:
        checkpoint = read_checkpoint(self.checkpoint_path)
        from_checkpoint = None
        if checkpoint is not None:
            if (checkpoint.run_id, checkpoint.incarnation) == (
                self.run_id,
                admission.incarnation_seq,
            ):
                from_checkpoint = checkpoint.next_step
            else:
                log.warning(
                    "%s: ignoring %s, written for another life of this run id",
                    self.run_id,
                    self.checkpoint_path,
                )
        progress = await read_progress(self.bus, self.run_id)
        from_trainer = None
        if progress is not None and progress.updated_at >= admission.incarnation_time.timestamp():
            from_trainer = progress.step
        from_stream, batch = await last_published_batch(
            self.bus, self.run_id, since=admission.incarnation_time
        )
        if batch is not None and batch.step not in recorded_steps(self.metrics_path):
            # killed between the publish and the metrics line: the line comes from the batch
            append_metrics(self.metrics_path, recovered_metrics(batch, time.time()))
            log.info("%s: step %d's metrics line rebuilt from its batch", self.run_id, batch.step)
        step = resume_step(from_checkpoint, from_trainer, from_stream)
        if step:
            log.info(
                "%s: resuming at step %d (checkpoint: %s, trainer: %s, last on stream: %s)",
                self.run_id,
                step,
                from_checkpoint,
                from_trainer,
                from_stream,
            )
        return step

    async def _drive(self, stop: asyncio.Event) -> OrchestratorResult:
        assert self._versions is not None and self._steps is not None
        versions, config = self._versions, self.config
        last = config.max_steps - 1
        try:
            if self._evaluator is not None:
                await self._evaluate_base()
            while self.next_step < config.max_steps:
                step, started = self.next_step, time.monotonic()
                bound = max(0, step - config.max_async_level)
                if versions.latest < bound:
                    log.info(
                        "%s: step %d waits for policy version %d (trainer announced %d)",
                        self.run_id,
                        step,
                        bound,
                        versions.latest,
                    )
                    await self._unless_stopped(versions.wait_for(bound), stop)
                if stop.is_set():
                    raise _Stopped
                await self._steps.run(step, bound, started)
                self.next_step = step + 1
                self.steps_published += 1
                if self._evaluator is not None and step != last and eval_due(step, config):
                    await self._evaluate_policy(step, versions.latest)
            if self.wait_for_training and versions.latest < config.max_steps:
                log.info(
                    "%s: all %d steps published; waiting for the trainer to announce version %d",
                    self.run_id,
                    config.max_steps,
                    config.max_steps,
                )
                await self._unless_stopped(versions.wait_for(config.max_steps), stop)
            if self._evaluator is not None and self.steps_published and eval_due(last, config):
                await self._evaluate_policy(last, versions.latest)
        except (_Stopped, GenerationStopped):
            log.info("%s: stopped before step %d", self.run_id, self.next_step)
            return self._result("stopped", f"stopped before step {self.next_step}")
        log.info("%s: done (%d steps)", self.run_id, config.max_steps)
        return self._result("done")

    async def _evaluate_base(self) -> None:
        """The base on the held-out prompts, once per run (stored; a resumed run reads it)."""
        assert self._evaluator is not None
        if self.next_step > 0 and not self._evaluator.base_path.exists():
            log.warning(
                "%s: resumed at step %d without a base evaluation; the base is no longer served "
                "for this run, so its metrics carry no base_best",
                self.run_id,
                self.next_step,
            )
            return
        try:
            self._base = await self._evaluator.base()
        except EvalUnavailable as exc:
            log.warning("%s: no base evaluation: %s", self.run_id, exc)
            return
        log.info(
            "%s: base on %d held-out prompts: %s; best %.3f at temperature %g",
            self.run_id,
            len(self._evaluator.prompts),
            ", ".join(f"T={t:g}: {r:.3f}" for t, r in self._base.by_temperature.items()),
            self._base.best,
            self._base.best_temperature,
        )

    async def _evaluate_policy(self, step: int, min_version: int) -> None:
        """The policy on the held-out prompts, added to ``step``'s metrics line."""
        assert self._evaluator is not None
        result = await self._evaluator.policy(step, min_version)
        merge_metrics(self.metrics_path, step, fields_of(result, self._base))
        gain = "" if self._base is None else f", gain {result.greedy - self._base.best:+.3f}"
        log.info(
            "%s step %d: held-out greedy %.3f, pass@%d %.3f (policy v%d)%s",
            self.run_id,
            step,
            result.greedy,
            result.pass_k,
            result.pass_at_k,
            result.policy_version,
            gain,
        )

    async def _unless_stopped(self, work: Awaitable[Any], stop: asyncio.Event) -> None:
        finished, _ = await _race(work, stop.wait())
        if not finished:
            raise _Stopped


async def _race(work: Awaitable[T], interrupt: Awaitable[Any]) -> tuple[bool, T | None]:
    """Await ``work`` unless ``interrupt`` completes first, in which case ``work`` is cancelled.

    Returns ``(True, result)`` or ``(False, None)``. Whatever happens, including the caller
    being cancelled, neither awaitable is left running.
    """
    task = asyncio.ensure_future(work)
    other = asyncio.ensure_future(interrupt)
    try:
        await asyncio.wait({task, other}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        other.cancel()
        await _cancelled(task)
    if task.cancelled():
        return False, None
    return True, task.result()


CANCEL_AGAIN_S = 1.0
"""seconds a cancelled task may go on before it is cancelled again"""


async def _cancelled(task: asyncio.Future[Any]) -> None:
    """Cancel ``task`` (unless it is done) and return once it has ended.

    A cancellation can be lost: Python 3.11's ``asyncio.wait_for`` returns the result instead
    of raising CancelledError when the future it waits for completes in the same turn of the
    event loop as the cancellation (fixed in 3.12). nats-py awaits every reply that way, so
    under load the cancellation of a step whose run was evicted was lost now and then, and the
    step went on retrying requests of a run that no longer exists, for ever. So the task is
    cancelled again while it goes on; a cancellation of the caller meanwhile is raised once the
    task has ended.
    """
    interrupted = False
    while not task.done():
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=CANCEL_AGAIN_S)
        except asyncio.CancelledError:
            interrupted = True
    if interrupted:
        raise asyncio.CancelledError
