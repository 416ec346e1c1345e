"""Per-step metrics of a run, one JSON object per line in ``{output_dir}/<run_id>/metrics.jsonl``.

Each line describes one published step (DESIGN.md guarantees ``step``, ``reward_mean``,
``policy_lag``, ``entropy_mean``, ``zero_spread_frac`` and, on eval steps, the held-out
rewards)::

    {"step": 3, "reward_mean": 0.41, "reward_std": 0.22, "policy_version": 2, "policy_lag": 1,
     "completion_len_mean": 5.5, "truncated_frac": 0.25, "num_samples": 64,
     "generation_s": 0.81, "tokens_per_s": 435.0, "wait_s": 0.0, "step_s": 0.86,
     "retries": 0, "time": 1718000000.0, "entropy_mean": 0.93, "zero_spread_frac": 0.125,
     "dropped_groups": 0}

- ``policy_lag`` is ``step - policy_version``: how many optimizer steps behind the batch's
  oldest sample was (at most ``max_async_level``);
- ``generation_s`` is the wall time from the first request to the last reply, and
  ``tokens_per_s`` the completion tokens generated in it;
- ``wait_s`` is the time the step waited for the off-policy bound (the trainer), ``step_s`` the
  whole step including that wait and the publish;
- ``truncated_frac`` is the fraction of completions cut by ``max_tokens`` instead of ending on
  end-of-sequence;
- ``entropy_mean`` is the mean of ``-log q(token)`` over the sampled completion tokens, ``q``
  the distribution each was sampled from: a Monte-Carlo estimate of the sampling policy's
  per-token entropy (exact in expectation, noisy per step; 0 under greedy decoding). A collapse
  towards 0 means the policy turned greedy;
- ``zero_spread_frac`` is the fraction of the step's groups whose rewards are all equal (they
  carry no advantage); with dynamic sampling it counts every group generated, the
  ``dropped_groups`` among them included.

On an eval step the line also holds the held-out evaluation
(:mod:`services.orchestrator.evaluation`): ``heldout_greedy``, ``heldout_sampled``,
``heldout_pass_at_k``, ``pass_k``, ``eval_policy_version`` and the base model's ``base_greedy``,
``base_best`` and ``base_best_temperature`` (0 for greedy). The evaluation ends after the step's
line was written, so :func:`merge_metrics` rewrites that line in place (an atomic replace).

A step republished after a crash may appear twice; readers keep the last line of each step.
A step whose line the crash lost (killed after the publish, before the append) gets it back
when the orchestrator restarts: rebuilt from the batch on the stream
(:func:`recovered_metrics`), marked ``"recovered": true``, its timings and ``truncated_frac``
0 (the batch does not carry them).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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
    entropy_mean: float = 0.0
    zero_spread_frac: float = 0.0
    dropped_groups: int = 0
    recovered: bool = False
    """rebuilt from the published batch after a crash lost the line (written only when true)"""

    def to_json(self) -> str:
        row = asdict(self)
        if not self.recovered:
            del row["recovered"]
        return json.dumps(row, separators=(",", ":"), allow_nan=False)


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
    group_size: int | None = None,
) -> StepMetrics:
    """The metrics of a published batch (pure: the caller supplies the clock readings).

    Groups are ``group_size`` consecutive samples; without it, runs of consecutive samples with
    the same prompt (two equal prompts side by side then count as one group).
    """
    rewards = [s.reward for s in batch.samples]
    lengths = [len(s.completion_ids) for s in batch.samples]
    tokens = sum(lengths)
    logprobs = [lp for s in batch.samples for lp in s.completion_logprobs]
    groups = reward_groups(batch, group_size)
    flat = sum(1 for g in groups if max(g) == min(g))
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
        entropy_mean=round(-_mean(logprobs), 6) if logprobs else 0.0,
        zero_spread_frac=round(flat / len(groups), 6) if groups else 0.0,
    )


def reward_groups(batch: RolloutBatch, group_size: int | None = None) -> list[list[float]]:
    """The rewards of the batch's groups, in order (see :func:`step_metrics`)."""
    samples = batch.samples
    if group_size is not None:
        if group_size < 1 or len(samples) % group_size:
            raise ValueError(f"{len(samples)} samples do not split into groups of {group_size}")
        return [
            [s.reward for s in samples[i : i + group_size]]
            for i in range(0, len(samples), group_size)
        ]
    groups: list[list[float]] = []
    previous: list[int] | None = None
    for s in samples:
        if s.prompt_ids != previous:
            groups.append([])
            previous = s.prompt_ids
        groups[-1].append(s.reward)
    return groups


def recovered_metrics(batch: RolloutBatch, now: float) -> StepMetrics:
    """The line of a published step whose own line a crash lost: what the batch tells."""
    metrics = step_metrics(
        batch, num_truncated=0, generation_s=0.0, wait_s=0.0, step_s=0.0, retries=0, now=now
    )
    return dataclasses.replace(metrics, recovered=True)


def recorded_steps(path: Path) -> set[int]:
    """The steps ``path`` has a whole line for."""
    steps: set[int] = set()
    if not path.exists():
        return steps
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line a crash cut short
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            steps.add(row["step"])
    return steps


def metrics_path(output_dir: Path | str, run_id: str) -> Path:
    """``{output_dir}/<run_id>/metrics.jsonl``."""
    return run_dir(output_dir, run_id) / METRICS_NAME


def append_metrics(path: Path, metrics: StepMetrics) -> None:
    """Append one line. A single ``write`` of a line in append mode, so a concurrent reader
    (``plexrl up``'s live view) sees whole lines; a crash can at worst cut the last one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(metrics.to_json() + "\n")


def merge_metrics(path: Path, step: int, fields: Mapping[str, Any]) -> None:
    """Add ``fields`` to the last line of ``step`` (a new line if there is none), rewriting the
    file through a temporary file and an atomic replace, so a reader sees the old file or the
    new one, never half of either."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    target = None
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and row.get("step") == step:
            target = (i, row)
    encoded = {k: v for k, v in fields.items() if k != "step"}
    if target is None:
        lines.append(json.dumps({"step": step, **encoded}, separators=(",", ":"), allow_nan=False))
    else:
        i, row = target
        lines[i] = json.dumps(row | encoded, separators=(",", ":"), allow_nan=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)
