"""The live terminal view and the end-of-run summary of ``plexrl up``.

Both read each run's ``metrics.jsonl`` (one JSON object per step, written by its orchestrator),
so the view shows exactly what is recorded on disk.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table


@dataclass
class RunView:
    run_id: str
    env: str
    max_steps: int
    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    _offset: int = 0
    status: str = "starting"

    def refresh(self) -> None:
        """Read lines appended since the last call (a partial last line waits for the next)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        for line in chunk[: end + 1].splitlines():
            if line.strip():
                self.rows.append(json.loads(line))
        self._offset += end + 1

    def rewards(self) -> list[float]:
        return [float(r["reward_mean"]) for r in self.rows]

    def window_means(self, fraction: float = 0.2) -> tuple[float, float]:
        """Mean reward over the first and the last ``fraction`` of recorded steps."""
        rewards = self.rewards()
        if not rewards:
            return math.nan, math.nan
        k = max(1, round(len(rewards) * fraction))
        return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def live_table(runs: list[RunView], elapsed: float, title: str) -> Table:
    table = Table(title=f"{title}  ({elapsed:.0f}s)", expand=False)
    for col in ("run", "env", "step", "reward", "lag", "tokens/s", "status"):
        table.add_column(col, justify="left" if col in ("run", "env", "status") else "right")
    for run in runs:
        last = run.rows[-1] if run.rows else {}
        table.add_row(
            run.run_id,
            run.env,
            f"{int(last['step']) + 1}/{run.max_steps}" if last else f"0/{run.max_steps}",
            _fmt(last.get("reward_mean")),
            str(last.get("policy_lag", "-")),
            _fmt(last.get("tokens_per_s"), ".0f"),
            run.status,
        )
    return table


def summary_table(runs: list[RunView]) -> Table:
    table = Table(title="plexrl up: summary (mean reward over the first and last 20% of steps)")
    for col in ("run", "env", "steps", "first 20%", "last 20%", "gain", "plot"):
        table.add_column(col)
    for run in runs:
        first, last = run.window_means()
        table.add_row(
            run.run_id,
            run.env,
            str(len(run.rows)),
            _fmt(first),
            _fmt(last),
            _fmt(last - first, "+.3f"),
            f"{run.run_id}/reward.png",
        )
    return table


def plot_rewards(run: RunView) -> Path | None:
    """Write ``reward.png`` beside the run's metrics: reward per step and its spread."""
    if not run.rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(r["step"]) for r in run.rows]
    mean = run.rewards()
    std = [float(r.get("reward_std", 0.0)) for r in run.rows]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, mean, color="tab:blue", label="reward mean")
    ax.fill_between(
        steps,
        [m - s for m, s in zip(mean, std, strict=True)],
        [m + s for m, s in zip(mean, std, strict=True)],
        color="tab:blue",
        alpha=0.15,
        label="± std",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{run.run_id} ({run.env})")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = run.path.parent / "reward.png"
    fig.savefig(out)
    plt.close(fig)
    return out
