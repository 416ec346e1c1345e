"""The live view and the summary read metrics.jsonl as the orchestrator writes it: lines
appended per step and an eval step's line rewritten in place."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from services.orchestrator.metrics import merge_metrics
from services.up.view import RunView, live_table, plot_rewards, summary_record, summary_table


def _write(path: Path, rows: list[dict[str, object]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _step(step: int, reward: float, entropy: float) -> dict[str, object]:
    return {
        "step": step,
        "reward_mean": reward,
        "reward_std": 0.1,
        "policy_lag": 1,
        "tokens_per_s": 100.0,
        "entropy_mean": entropy,
        "zero_spread_frac": 0.25,
        "time": 1.0 + step,
    }


def _render(table: object) -> str:
    console = Console(width=300, record=True)
    console.print(table)
    return console.export_text()


def test_view_follows_appends_and_in_place_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "run_a" / "metrics.jsonl"
    view = RunView("run_a", "reverse", 10, path)
    view.refresh()
    assert view.rows == [] and view.heldout() == {}
    _write(path, [_step(s, 0.1 * s, 1.0 - 0.1 * s) for s in range(5)])
    with path.open("a") as f:
        f.write('{"step": 5, "rew')  # not yet complete
    view.refresh()
    assert [r["step"] for r in view.rows] == [0, 1, 2, 3, 4]
    merge_metrics(
        path,
        4,
        {
            "heldout_greedy": 0.6,
            "heldout_pass_at_k": 0.8,
            "pass_k": 4,
            "base_best": 0.45,
            "base_best_temperature": 0.1,
        },
    )
    view.refresh()
    assert [r["step"] for r in view.rows] == [0, 1, 2, 3, 4]
    assert view.heldout() == {
        "heldout_greedy": 0.6,
        "heldout_pass_at_k": 0.8,
        "pass_k": 4,
        "base_best": 0.45,
        "base_best_temperature": 0.1,
        "gain": 0.15,
    }
    record = summary_record(view)
    assert record["steps"] == 5 and record["gain"] == 0.15
    assert record["entropy_last_20pct"] == 0.6  # the last step of five
    text = _render(summary_table([view]))
    for expected in ("base best (held-out)", "0.450 (T=0.1)", "0.600", "0.800 (k=4)", "+0.150"):
        assert expected in text
    live = _render(live_table([view], 3.0, "up"))
    assert "entropy" in live and "zero-spread" in live and "25%" in live and "0.60" in live
    png = plot_rewards(view)
    assert png is not None and png.stat().st_size > 0


def test_summary_without_evaluation_shows_dashes(tmp_path: Path) -> None:
    path = tmp_path / "run_b" / "metrics.jsonl"
    _write(path, [{"step": 0, "reward_mean": 0.2, "policy_lag": 0}])
    view = RunView("run_b", "add", 3, path)
    view.refresh()
    record = summary_record(view)
    assert record["entropy_last_20pct"] is None and "gain" not in record
    row = [line for line in _render(summary_table([view])).splitlines() if "run_b" in line]
    assert row and row[0].count(" - ") >= 4
