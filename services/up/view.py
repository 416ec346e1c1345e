"""The live terminal view and the end-of-run summary of ``plexrl up``.

Both read each run's ``metrics.jsonl`` (one JSON object per step, written by its orchestrator),
so the view shows exactly what is recorded on disk.

The summary's honest measure is held-out: ``base best`` is the base model's best mean reward on
the held-out prompts over greedy decoding and a few temperatures, ``held-out greedy`` and
``pass@k`` are the trained policy's on the same prompts at its last evaluation, and ``gain`` is
``held-out greedy - base best``: what training added over the best the base does untrained.
The training reward (sampled at the run's temperature, on training prompts) is shown too, but
it also rises when the policy merely turns greedy, which ``entropy`` (the mean ``-log q`` of the
sampled tokens) shows falling.
"""

from __future__ import annotations

import json
import math
import os
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
    """one row per step, in step order: the last line written for each step"""
    _seen: tuple[int, int, int] = (-1, -1, -1)
    status: str = "starting"

    def refresh(self) -> None:
        """Re-read the file if it changed: the orchestrator appends a line per step and rewrites
        an eval step's line in place, so the whole file is read (a partial last line, cut by a
        crash or not yet complete, is skipped)."""
        try:
            st = os.stat(self.path)
            if (st.st_ino, st.st_size, st.st_mtime_ns) == self._seen:
                return
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        self._seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        by_step: dict[int, dict[str, Any]] = {}
        for line in data[: data.rfind(b"\n") + 1].splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                by_step[row["step"]] = row
        self.rows = [by_step[k] for k in sorted(by_step)]

    def rewards(self) -> list[float]:
        return [float(r["reward_mean"]) for r in self.rows if "reward_mean" in r]

    def evals(self) -> list[dict[str, Any]]:
        """The rows of eval steps (those holding ``heldout_greedy``)."""
        return [r for r in self.rows if r.get("heldout_greedy") is not None]

    def heldout(self) -> dict[str, Any]:
        """The last evaluation, with ``gain = heldout_greedy - base_best`` (empty if none)."""
        evals = self.evals()
        if not evals:
            return {}
        last = evals[-1]
        out = {
            k: last.get(k)
            for k in (
                "heldout_greedy",
                "heldout_pass_at_k",
                "pass_k",
                "base_best",
                "base_best_temperature",
            )
        }
        best = out["base_best"]
        if best is not None:
            out["gain"] = round(float(last["heldout_greedy"]) - float(best), 6)
        return out

    def recent(self, key: str, fraction: float = 0.2) -> float:
        """Mean of ``key`` over the last ``fraction`` of recorded steps (nan if never recorded)."""
        xs = [float(r[key]) for r in self.rows if r.get(key) is not None]
        if not xs:
            return math.nan
        k = max(1, round(len(xs) * fraction))
        return sum(xs[-k:]) / k

    def window_means(self, fraction: float = 0.2) -> tuple[float, float]:
        """Mean reward over the first and the last ``fraction`` of recorded steps."""
        rewards = self.rewards()
        if not rewards:
            return math.nan, math.nan
        k = max(1, round(len(rewards) * fraction))
        return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def live_table(
    runs: list[RunView], elapsed: float, title: str, caption: str | None = None
) -> Table:
    """One row per run; ``caption`` (below the rows) says what happened to the services."""
    table = Table(
        title=f"{title}  ({elapsed:.0f}s)",
        expand=False,
        caption=caption,
        caption_justify="left",
        caption_style="yellow",
    )
    heads = ("run", "env", "step", "reward", "entropy", "zero-spread", "held-out", "lag")
    for col in (*heads, "tokens/s", "status"):
        table.add_column(col, justify="left" if col in ("run", "env", "status") else "right")
    for run in runs:
        last = run.rows[-1] if run.rows else {}
        table.add_row(
            run.run_id,
            run.env,
            f"{int(last['step']) + 1}/{run.max_steps}" if last else f"0/{run.max_steps}",
            _fmt(last.get("reward_mean")),
            _fmt(last.get("entropy_mean"), ".2f"),
            _fmt(last.get("zero_spread_frac"), ".0%"),
            _fmt(run.heldout().get("heldout_greedy")),
            str(last.get("policy_lag", "-")),
            _fmt(last.get("tokens_per_s"), ".0f"),
            run.status,
        )
    return table


def summary_table(runs: list[RunView]) -> Table:
    table = Table(
        title="plexrl up: summary (train reward: first and last 20% of steps; held-out: the "
        "last evaluation; gain = held-out greedy - base best)"
    )
    heads = ("run", "env", "steps", "train first 20%", "train last 20%", "base best (held-out)")
    for col in (*heads, "held-out greedy", "held-out pass@k", "gain", "entropy", "plot"):
        table.add_column(col)
    for run in runs:
        first, last = run.window_means()
        held = run.heldout()
        best = held.get("base_best")
        table.add_row(
            run.run_id,
            run.env,
            str(len(run.rows)),
            _fmt(first),
            _fmt(last),
            "-" if best is None else f"{best:.3f} (T={held['base_best_temperature']:g})",
            _fmt(held.get("heldout_greedy")),
            _pass_at_k(held),
            _fmt(held.get("gain"), "+.3f"),
            _fmt(run.recent("entropy_mean"), ".2f"),
            f"{run.run_id}/reward.png",
        )
    return table


def summary_record(run: RunView) -> dict[str, Any]:
    """The numbers of one run's summary row, for ``summary.json``."""
    first, last = run.window_means()
    entropy = run.recent("entropy_mean")
    return {
        "steps": len(run.rows),
        "reward_first_20pct": first,
        "reward_last_20pct": last,
        "entropy_last_20pct": None if math.isnan(entropy) else round(entropy, 4),
    } | run.heldout()


def _pass_at_k(held: dict[str, Any]) -> str:
    if held.get("heldout_pass_at_k") is None:
        return "-"
    return f"{held['heldout_pass_at_k']:.3f} (k={held['pass_k']})"


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
    evals = run.evals()
    if evals:
        ax.plot(
            [int(r["step"]) for r in evals],
            [float(r["heldout_greedy"]) for r in evals],
            "o-",
            color="tab:green",
            label="held-out greedy",
        )
        best = evals[-1].get("base_best")
        if best is not None:
            ax.axhline(float(best), color="tab:gray", ls="--", label="base best (held-out)")
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
