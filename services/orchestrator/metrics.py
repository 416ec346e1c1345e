"""Per-step metrics of a run, one JSON object per line in ``{output_dir}/<run_id>/metrics.jsonl``.

Each line describes one published step (DESIGN.md guarantees ``step``, ``reward_mean`` and
``policy_lag``)::

    {"step": 3, "reward_mean": 0.41, "reward_std": 0.22, "policy_version": 2, "policy_lag": 1,
     "completion_len_mean": 5.5, "truncated_frac": 0.25, "num_samples": 64,
     "generation_s": 0.81, "tokens_per_s": 435.0, "wait_s": 0.0, "step_s": 0.86,
     "retries": 0, "time": 1718000000.0}

- ``policy_lag`` is ``step - policy_version``: how many optimizer steps behind the batch's
  oldest sample was (at most ``max_async_level``);
- ``generation_s`` is the wall time from the first request to the last reply, and
  ``tokens_per_s`` the completion tokens generated in it;
- ``wait_s`` is the time the step waited for the off-policy bound (the trainer), ``step_s`` the
  whole step including that wait and the publish;
- ``truncated_frac`` is the fraction of completions cut by ``max_tokens`` instead of ending on
  end-of-sequence.

A step republished after a crash may appear twice; readers keep the last line of each step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from schemas.events import RolloutBatch
from services.orchestrator.state import run_dir

METRICS_NAME = "metrics.jsonl"


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one step did; field names are the JSON keys."""

    step: int
    reward_mean: float
    reward_std: float
    policy_version: int
    policy_lag: int
    completion_len_mean: float
    truncated_frac: float
    num_samples: int
    generation_s: float
    tokens_per_s: float
    wait_s: float
    step_s: float
    retries: int
    time: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), allow_nan=False)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    """Population standard deviation, as the advantages use."""
    if not xs:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def step_metrics(
    batch: RolloutBatch,
    *,
    num_truncated: int,
    generation_s: float,
    wait_s: float,
    step_s: float,
    retries: int,
    now: float,
) -> StepMetrics:
    """The metrics of a published batch (pure: the caller supplies the clock readings)."""
    rewards = [s.reward for s in batch.samples]
    lengths = [len(s.completion_ids) for s in batch.samples]
    tokens = sum(lengths)
    return StepMetrics(
        step=batch.step,
        reward_mean=round(_mean(rewards), 6),
        reward_std=round(_std(rewards), 6),
        policy_version=batch.policy_version,
        policy_lag=batch.step - batch.policy_version,
        completion_len_mean=round(_mean(lengths), 4),
        truncated_frac=round(num_truncated / len(lengths), 4) if lengths else 0.0,
        num_samples=len(batch.samples),
        generation_s=round(generation_s, 4),
        tokens_per_s=round(tokens / generation_s, 2) if generation_s > 0 else 0.0,
        wait_s=round(wait_s, 4),
        step_s=round(step_s, 4),
        retries=retries,
        time=round(now, 3),
    )


def metrics_path(output_dir: Path | str, run_id: str) -> Path:
    """``{output_dir}/<run_id>/metrics.jsonl``."""
    return run_dir(output_dir, run_id) / METRICS_NAME


def append_metrics(path: Path, metrics: StepMetrics) -> None:
    """Append one line. A single ``write`` of a line in append mode, so a concurrent reader
    (``plexrl up``'s live view) sees whole lines; a crash can at worst cut the last one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(metrics.to_json() + "\n")
