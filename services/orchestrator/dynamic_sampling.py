"""The run loop's step: :class:`~.step.StepRunner` plus group statistics and dynamic sampling.

:class:`FilteringStepRunner` is the StepRunner the run loop uses. It keeps the step's flow
(plan, generate, score, publish, record) and adds two things through the runner's generate and
score stages:

- exact group statistics: ``zero_spread_frac`` over every group the step generated and
  ``dropped_groups``, written into the step's metrics line;
- with ``advantage.dynamic_sampling``, groups whose rewards are all equal are dropped after
  generation and replaced by refill prompts (:func:`.rollouts.plan_refill`), generated against
  the same policy bound, for at most :data:`.rollouts.MAX_REFILL_ROUNDS` rounds; a batch still
  short after that is topped up with dropped groups and the step says so in the log (see
  :mod:`.rollouts` for why).

The generate stage receives only the step's requests, so :meth:`FilteringStepRunner.run`
notes the step it runs and the generate stage rebuilds the step's plan (a pure function of the
step); the score stage then assembles the batch from the groups the generate stage kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field

from schemas.events import Completion, GenerateRequest, RolloutBatch
from services.orchestrator import rollouts
from services.orchestrator.metrics import StepMetrics, reward_groups
from services.orchestrator.rollouts import PlannedPrompt, ScoredGroup
from services.orchestrator.step import ScoringError, StepRunner

log = logging.getLogger(__name__)


@dataclass
class _StepState:
    step: int
    min_version: int
    generated: int = 0
    zero_spread: int = 0
    dropped: int = 0
    kept: list[ScoredGroup] = field(default_factory=list)


class FilteringStepRunner(StepRunner):
    """A StepRunner with group statistics and optional dynamic sampling; see the module."""

    _state: _StepState | None = None

    async def run(self, step: int, min_version: int, started: float) -> StepMetrics:
        self._state = _StepState(step, min_version)
        try:
            return await super().run(step, min_version, started)
        finally:
            self._state = None

    async def _generate_all(
        self, requests: list[GenerateRequest]
    ) -> tuple[list[list[Completion]], list[int]]:
        groups, versions = await super()._generate_all(requests)
        state = self._state
        if state is None or not self.config.advantage.dynamic_sampling:
            return groups, versions
        size = self.config.batch_size
        planned = rollouts.plan_step(self.env, self.tokenizer, state.step, size)
        kept, dropped = await self._sort(planned, groups, versions, [])
        for refill_round in range(1, rollouts.MAX_REFILL_ROUNDS + 1):
            if len(kept) >= size:
                break
            extra = rollouts.plan_refill(
                self.env, self.tokenizer, state.step, refill_round, size - len(kept)
            )
            more, more_versions = await super()._generate_all(
                [
                    rollouts.build_request(
                        self.run_id,
                        self.config,
                        state.step,
                        p,
                        state.min_version,
                        self.version_wait_s,
                    )
                    for p in extra
                ]
            )
            kept, new_dropped = await self._sort(extra, more, more_versions, kept)
            dropped += new_dropped
        if len(kept) < size:
            log.warning(
                "%s step %d: %d of %d groups have reward spread after %d refill rounds; "
                "publishing %d groups without spread (advantage 0) to fill the batch",
                self.run_id,
                state.step,
                len(kept),
                size,
                rollouts.MAX_REFILL_ROUNDS,
                size - len(kept),
            )
            kept = rollouts.top_up(kept, dropped, size)
        state.kept = kept
        state.dropped = len(dropped)
        return [g.completions for g in kept], [g.policy_version for g in kept]

    async def _sort(
        self,
        planned: list[PlannedPrompt],
        groups: list[list[Completion]],
        versions: list[int],
        kept: list[ScoredGroup],
    ) -> tuple[list[ScoredGroup], list[ScoredGroup]]:
        assert self._state is not None
        rewards = await asyncio.to_thread(self._rewards, planned, groups)
        scored = [
            ScoredGroup(p, g, r, v)
            for p, g, r, v in zip(planned, groups, rewards, versions, strict=True)
        ]
        self._state.generated += len(scored)
        self._state.zero_spread += sum(not rollouts.has_spread(g.rewards) for g in scored)
        return rollouts.fill_groups(kept, scored, self.config.batch_size)

    def _rewards(
        self, planned: list[PlannedPrompt], groups: list[list[Completion]]
    ) -> list[list[float]]:
        try:
            return [
                rollouts.score_group(self.env, self.tokenizer, p.prompt, g)
                for p, g in zip(planned, groups, strict=True)
            ]
        except Exception as exc:
            step = self._state.step if self._state is not None else -1
            raise ScoringError(
                f"environment {self.config.env!r} failed to score step {step}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def _score(
        self,
        step: int,
        planned: list[PlannedPrompt],
        groups: list[list[Completion]],
        versions: list[int],
    ) -> RolloutBatch:
        state = self._state
        if state is None or not state.kept:
            batch = super()._score(step, planned, groups, versions)
            if state is not None:
                # the step's groups in order, group_size samples each
                flat = reward_groups(batch, self.config.group_size)
                state.generated = len(flat)
                state.zero_spread = sum(not rollouts.has_spread(r) for r in flat)
            return batch
        try:
            return rollouts.assemble_batch(
                self.run_id,
                step,
                [g.planned for g in state.kept],
                [g.completions for g in state.kept],
                [g.rewards for g in state.kept],
                [g.policy_version for g in state.kept],
                std_normalize=self.config.advantage.std_normalize,
            )
        except ValueError as exc:
            raise ScoringError(f"step {step}: {exc}") from exc

    def _record(self, step: int, metrics: StepMetrics) -> None:
        state = self._state
        if state is not None and state.generated:
            metrics = dataclasses.replace(
                metrics,
                zero_spread_frac=round(state.zero_spread / state.generated, 6),
                dropped_groups=state.dropped,
            )
        super()._record(step, metrics)
