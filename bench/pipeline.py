"""Synchronous vs asynchronous RL: wall time of the same steps at max_async_level 0, 1 and 2.

Each level runs ``plexrl up`` (one run by default, the warm-started tiny model, the same seed)
and reads what the run recorded: the orchestrator's ``metrics.jsonl`` (generation time per
step, and at level 0 the time spent waiting for the trainer's new version, i.e. training plus
weight sync) and the trainer's ``trainer_steps.jsonl``. Wall time runs from the start of the
first step's generation to the commit of the last trained step, so process start-up is not
counted.

With generation taking G and training-plus-sync T per step, a synchronous loop needs about
``G + T`` per step and a perfectly overlapped one ``max(G, T)``: ``(G + T) / max(G, T)`` is the
best speed-up asynchrony can give, and the table says how close each level gets.

    .venv/bin/python bench/pipeline.py [--steps 20] [--runs 1] [--env reverse]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

from services.up.app import ensure_tiny_model


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_level(level: int, args: argparse.Namespace, model: Path, root: Path) -> dict[str, float]:
    out = root / f"level{level}"
    config = root / f"level{level}.toml"
    config.write_text(f'envs = ["{args.env}"]\n')
    cmd = [sys.executable, "-m", "services", "up", "--runs", str(args.runs), "--steps", str(args.steps),
           "--max-async-level", str(level), "--model", str(model), "--output-dir", str(out),
           "--config", str(config), "--no-live"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"plexrl up failed at level {level}:\n{done.stdout}\n{done.stderr}")
    walls, gens, waits, first, last = [], [], [], [], []
    for run_dir in sorted(out.glob("run_*")):
        metrics = _lines(run_dir / "metrics.jsonl")
        trained = _lines(run_dir / "trainer_steps.jsonl")
        start = metrics[0]["time"] - metrics[0]["step_s"]
        walls.append(max(t["time"] for t in trained) - start)
        gens += [m["generation_s"] for m in metrics]
        waits += [m["wait_s"] for m in metrics[1:]]
        k = max(1, len(metrics) // 5)
        first.append(statistics.mean(m["reward_mean"] for m in metrics[:k]))
        last.append(statistics.mean(m["reward_mean"] for m in metrics[-k:]))
    return {
        "wall_s": max(walls),
        "gen_s": statistics.mean(gens),
        "wait_s": statistics.mean(waits) if waits else 0.0,
        "reward_first": statistics.mean(first),
        "reward_last": statistics.mean(last),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--env", default="reverse")
    args = p.parse_args()
    model = ensure_tiny_model(Console(stderr=True))
    with tempfile.TemporaryDirectory(prefix="plexrl-pipeline-") as tmp:
        results = {level: run_level(level, args, model, Path(tmp)) for level in (0, 1, 2)}
    sync = results[0]
    gen = sync["gen_s"]
    train = max(sync["wait_s"], 1e-9)  # at level 0 every step waits for the previous one's training
    best = (gen + train) / max(gen, train)
    print(f"{args.runs} run(s) x {args.steps} steps; per step at level 0: generation {gen:.3f}s, "
          f"training + weight sync {train:.3f}s; best possible speed-up (G+T)/max(G,T) = {best:.2f}x\n")  # fmt: skip
    print(
        "| max_async_level | wall s | speed-up vs level 0 | share of best possible | reward first 20% | reward last 20% |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for level, r in results.items():
        speed = sync["wall_s"] / r["wall_s"]
        share = (speed - 1) / (best - 1) if best > 1 else 1.0
        print(
            f"| {level} | {r['wall_s']:.1f} | {speed:.2f}x | {share:.0%} | {r['reward_first']:.3f} | {r['reward_last']:.3f} |"
        )


if __name__ == "__main__":
    main()
