"""The end of a sweep: one row per run, written to ``sweep.json`` and ``sweep.csv``, and one PNG
overlaying every run's reward curve.

Columns: the run, each varied value, its status, steps trained, the mean training reward over
the first and last 20% of its steps, the held-out evaluation (the base's best, the policy's
greedy reward at its last evaluation and ``gain`` = held-out greedy - base best: see
:mod:`services.up.view`), the mean sampling entropy over the last 20% of steps, steps per second
(from the first to the last step's time stamp in ``metrics.jsonl``) and the mean policy lag.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from services.up.drive import Driven
from services.up.sweep import SweepRun
from services.up.view import RunView

SMOOTHING = 5
"""steps in the moving average the plot draws"""


def report_sweep(
    planned: list[SweepRun], driven: Driven, name: str, out_dir: Path, console: Console
) -> None:
    """Print the comparison table; write ``sweep.json``, ``sweep.csv`` and ``sweep.png``."""
    varied = list(dict.fromkeys(k for run in planned for k in run.values))
    rows = comparison_rows(planned, driven)
    title = f"sweep {name}: mean reward over the first and last 20% of steps"
    if not console.is_terminal:  # a log or a pipe: wide enough that no id or value is cut
        console = Console(file=console.file, width=max(console.width, 160))
    console.print(comparison_table(rows, varied, title))
    as_json, as_csv = write_comparison(rows, out_dir, name)
    png = plot_sweep(
        planned, driven, varied, out_dir / "sweep.png", f"sweep {name}: reward per step"
    )
    for reason in sorted(set(driven.early_stopped.values())):
        console.print(f"early stop: {reason}")
    console.print(f"sweep table: {as_json}, {as_csv}; reward curves: {png}")


def comparison_rows(planned: list[SweepRun], driven: Driven) -> list[dict[str, Any]]:
    rows = []
    for run, view, result in zip(planned, driven.views, driven.results, strict=True):
        first, last = view.window_means()
        held = view.heldout()
        status = "evicted (early stop)" if run.run_id in driven.early_stopped else result.status
        rows.append(
            {"run_id": run.run_id}
            | run.values
            | {
                "status": status,
                "steps": len(view.rows),
                "reward_first_20pct": _num(first),
                "reward_last_20pct": _num(last),
                "base_best": held.get("base_best"),
                "heldout_greedy": held.get("heldout_greedy"),
                "heldout_gain": held.get("gain"),
                "entropy": _num(view.recent("entropy_mean")),
                "steps_per_s": _steps_per_s(view),
                "policy_lag_mean": _mean([float(r["policy_lag"]) for r in view.rows]),
                "reason": result.reason,
            }
        )
    return rows


def _num(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def _steps_per_s(view: RunView) -> float | None:
    times = [float(r["time"]) for r in view.rows]
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return round((len(times) - 1) / (times[-1] - times[0]), 3)


def write_comparison(rows: list[dict[str, Any]], out_dir: Path, name: str) -> tuple[Path, Path]:
    """``sweep.json`` (the sweep's name and the rows) and ``sweep.csv`` (the rows) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    as_json, as_csv = out_dir / "sweep.json", out_dir / "sweep.csv"
    as_json.write_text(json.dumps({"sweep": name, "runs": rows}, indent=2) + "\n")
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(as_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return as_json, as_csv


def comparison_table(rows: list[dict[str, Any]], varied: list[str], title: str) -> Table:
    table = Table(title=title)
    heads = ["run", *varied, "status", "steps", "first 20%", "last 20%", "base best", "held-out"]
    heads += ["gain", "entropy", "steps/s", "lag"]
    for head in heads:
        left = head in ("run", "status")
        table.add_column(head, justify="left" if left else "right", no_wrap=left)
    for row in rows:
        table.add_row(
            row["run_id"],
            *(_cell(row.get(k)) for k in varied),
            row["status"],
            str(row["steps"]),
            _cell(row["reward_first_20pct"], ".3f"),
            _cell(row["reward_last_20pct"], ".3f"),
            _cell(row.get("base_best"), ".3f"),
            _cell(row.get("heldout_greedy"), ".3f"),
            _cell(row.get("heldout_gain"), "+.3f"),
            _cell(row.get("entropy"), ".2f"),
            _cell(row["steps_per_s"], ".2f"),
            _cell(row["policy_lag_mean"], ".2f"),
        )
    return table


def _cell(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    return format(v, spec) if spec else (f"{v:g}" if isinstance(v, float) else str(v))


def _label(values: dict[str, Any]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={_cell(v)}" for k, v in values.items())


def _smooth(xs: list[float], k: int) -> list[float]:
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x - (xs[i - k] if i >= k else 0.0)
        out.append(total / min(i + 1, k))
    return out


def plot_sweep(
    planned: list[SweepRun], driven: Driven, varied: list[str], out: Path, title: str
) -> Path:
    """One PNG: every run's reward per step (moving average), coloured by the first varied
    value, dashed by the second; a cross where the early-stop rule evicted a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colour_key = varied[0] if varied else ""
    style_key = varied[1] if len(varied) > 1 else ""
    colour_of = _palette([r.values.get(colour_key) for r in planned], plt)
    styles = ["-", "--", ":", "-."]
    style_values = list(dict.fromkeys(repr(r.values.get(style_key)) for r in planned))
    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    for run, view in zip(planned, driven.views, strict=True):
        if not view.rows:
            continue
        steps = [int(r["step"]) + 1 for r in view.rows]
        rewards = _smooth(view.rewards(), SMOOTHING)
        style = styles[style_values.index(repr(run.values.get(style_key))) % len(styles)]
        colour = colour_of[repr(run.values.get(colour_key))]
        ax.plot(steps, rewards, style, color=colour, lw=2, label=_label(run.values) or run.run_id)
        if run.run_id in driven.early_stopped:
            ax.plot(steps[-1], rewards[-1], "x", color=colour, ms=10, mew=2.5)
    ax.set_xlabel("step")
    ax.set_ylabel(f"reward (mean over {SMOOTHING} steps)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title + (" (x: stopped early)" if driven.early_stopped else ""))
    ax.grid(alpha=0.3)
    # beside the axes, where it never hides a curve
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def _palette(values: list[Any], plt: Any) -> dict[str, Any]:
    """A colour per distinct value, in sorted order along viridis (numbers) or tab10 (others)."""
    distinct = list(dict.fromkeys(values))
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in distinct)
    if numeric:
        distinct.sort()
        cmap = plt.get_cmap("viridis")
        n = max(len(distinct) - 1, 1)
        return {repr(v): cmap(0.9 * i / n) for i, v in enumerate(distinct)}
    cmap = plt.get_cmap("tab10")
    return {repr(v): cmap(i % 10) for i, v in enumerate(distinct)}
