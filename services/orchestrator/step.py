"""One step of a run, end to end: generate, score, publish, then record it.

:meth:`StepRunner.run` builds step ``n`` (the run loop has already waited for the off-policy
bound): it sends one GenerateRequest per prompt, all at once (at most
``max_concurrent_requests`` in flight), checks each reply, scores the completions and computes
advantages in a worker thread (an environment's scorer may be slow, and the event loop must keep
following evictions and weight announcements meanwhile), and publishes the RolloutBatch on the
run's rollouts subject (``plexrl.rollouts[.<tenant>].<run_id>``) with message id
``<run_id>/step_<n>``. Only then, in this order, does it append the step's metrics
line and write the checkpoint: a crash between the publish and the checkpoint is covered by the
stream on restart (see :mod:`services.orchestrator.state`).

Tracing: the span "orchestrator step" (``run_id``, ``step``, ``min_policy_version`` and, once
known, ``policy_version``) is current while the requests, the "score" span and the publish run,
so all of them belong to one trace per step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from schemas.config import OrchConfig
from schemas.events import Completion, GenerateRequest, RolloutBatch
from schemas.subjects import rollout_msg_id, tenant_rollouts_subject
from services.bus import Bus
from services.bus.tracing import tracer
from services.envs import Environment
from services.launch.faults import crash_point
from services.orchestrator import rollouts
from services.orchestrator.client import GenerateClient, GenerationStopped
from services.orchestrator.lifecycle import acting_tenant
from services.orchestrator.metrics import StepMetrics, append_metrics, metrics_path, step_metrics
from services.orchestrator.state import OrchestratorCheckpoint, checkpoint_path, write_checkpoint
from services.telemetry.metrics import record_step

log = logging.getLogger(__name__)


class ScoringError(RuntimeError):
    """The run's environment failed to score a step (raised, or returned NaN or inf)."""


class StepRunner:
    """Generates, scores, publishes and records the steps of one run (one incarnation).

    ``tenant`` (default: the tenant this process acts for) picks the rollouts subject.
    """

    def __init__(
        self,
        bus: Bus,
        run_id: str,
        config: OrchConfig,
        *,
        env: Environment,
        tokenizer: Any,
        client: GenerateClient,
        output_dir: Path,
        incarnation: int,
        max_concurrent_requests: int = 64,
        tenant: str | None = None,
    ) -> None:
        self.bus = bus
        self.run_id = run_id
        self.tenant = acting_tenant(tenant)
        self.subject = tenant_rollouts_subject(run_id, self.tenant)
        self.config = config
        self.env = env
        self.tokenizer = tokenizer
        self.client = client
        self.incarnation = incarnation
        self.metrics_path = metrics_path(output_dir, run_id)
        self.checkpoint_path = checkpoint_path(output_dir, run_id)
        self._in_flight = asyncio.Semaphore(max_concurrent_requests)
        self._tracer = tracer("plexrl.orchestrator")
        self._digest = config.digest()
        # A replica may first wait for the version, then generate: half the request's time for
        # each, so that a reply after a wait still arrives before the request times out.
        self.version_wait_s = min(max(client.timeout / 2, 0.1), 3600.0)

    async def run(self, step: int, min_version: int, started: float) -> StepMetrics:
        """Build and publish ``step``; ``started`` is when the loop began waiting for it."""
        wait_s = time.monotonic() - started
        retries_before = self.client.retries
        with self._tracer.start_as_current_span(
            "orchestrator step",
            attributes={"run_id": self.run_id, "step": step, "min_policy_version": min_version},
        ) as span:
            planned = rollouts.plan_step(self.env, self.tokenizer, step, self.config.batch_size)
            requests = [
                rollouts.build_request(
                    self.run_id, self.config, step, p, min_version, self.version_wait_s
                )
                for p in planned
            ]
            generation_started = time.monotonic()
            groups, versions = await self._generate_all(requests)
            generation_s = time.monotonic() - generation_started
            with self._tracer.start_as_current_span("score", attributes={"run_id": self.run_id}):
                batch = await asyncio.to_thread(self._score, step, planned, groups, versions)
            span.set_attribute("policy_version", batch.policy_version)
            ack = await self.bus.publish(
                self.subject, batch, msg_id=rollout_msg_id(self.run_id, step)
            )
        if ack.duplicate:
            # Harmless (the stream kept the first copy), but it means a resume started too early.
            log.warning(
                "%s: step %d was already on the stream; this copy was dropped", self.run_id, step
            )
        crash_point("orchestrator.publish", self.run_id, step)  # published, no metrics line yet
        metrics = step_metrics(
            batch,
            num_truncated=sum(c.finish_reason == "length" for g in groups for c in g),
            generation_s=generation_s,
            wait_s=wait_s,
            step_s=time.monotonic() - started,
            retries=self.client.retries - retries_before,
            now=time.time(),
        )
        self._record(step, metrics)
        return metrics

    def _record(self, step: int, metrics: StepMetrics) -> None:
        append_metrics(self.metrics_path, metrics)
        record_step(
            self.run_id,
            step=step,
            reward_mean=metrics.reward_mean,
            policy_lag=metrics.policy_lag,
            tokens_per_s=metrics.tokens_per_s,
            tenant=self.tenant,
        )
        write_checkpoint(
            self.checkpoint_path,
            OrchestratorCheckpoint(
                run_id=self.run_id,
                next_step=step + 1,
                next_prompt_index=(step + 1) * self.config.batch_size,
                incarnation=self.incarnation,
                config_digest=self._digest,
            ),
        )
        log.info(
            "%s step %d: reward %.3f ± %.3f, policy v%d (lag %d), %d samples, %.2fs (%.0f tok/s)",
            self.run_id,
            step,
            metrics.reward_mean,
            metrics.reward_std,
            metrics.policy_version,
            metrics.policy_lag,
            metrics.num_samples,
            metrics.generation_s,
            metrics.tokens_per_s,
        )

    async def _generate_all(
        self, requests: list[GenerateRequest]
    ) -> tuple[list[list[Completion]], list[int]]:
        """Send every request at once; the first failure cancels the others and is raised."""

        async def one(request: GenerateRequest) -> tuple[list[Completion], int]:
            async with self._in_flight:
                response = await self.client.generate(request)
            return rollouts.check_response(request, response), response.policy_version

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(one(r)) for r in requests]
        except BaseExceptionGroup as eg:
            # Callers handle plain exceptions. A stop wins over a failure it may have caused.
            leaves = _leaves(eg)
            stopped = [e for e in leaves if isinstance(e, GenerationStopped)]
            raise (stopped or leaves)[0] from None
        results = [t.result() for t in tasks]
        return [g for g, _ in results], [v for _, v in results]

    def _score(
        self,
        step: int,
        planned: list[rollouts.PlannedPrompt],
        groups: list[list[Completion]],
        versions: list[int],
    ) -> RolloutBatch:
        # The one boundary around the environment's code: whatever it raises, the run fails with
        # a message that names the environment and the step instead of a bare traceback.
        try:
            rewards = [
                rollouts.score_group(self.env, self.tokenizer, p.prompt, g)
                for p, g in zip(planned, groups, strict=True)
            ]
            return rollouts.assemble_batch(
                self.run_id,
                step,
                planned,
                groups,
                rewards,
                versions,
                std_normalize=self.config.advantage.std_normalize,
            )
        except Exception as exc:
            raise ScoringError(
                f"environment {self.config.env!r} failed to score step {step}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def _leaves(eg: BaseExceptionGroup[Any]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in eg.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
