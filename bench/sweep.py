"""A learning-rate sweep as one ``plexrl up`` vs the same runs one after another.

Both ways train the same runs (one task, ``--runs`` learning rates spaced evenly in log scale
between 1e-3 and 8e-3, ``--steps`` steps each, the warm-started tiny model): once as a sweep
through a single ``plexrl up`` (every run on the one trainer and inference replica, ``--max-runs``
at a time, the rest waiting in the registry's queue), once as ``--runs`` single-run ``plexrl up``
invocations in a row. Reported: total wall time of each way (process start-up included, since a
user pays it), the ratio, and peak memory: the largest sum of resident set sizes over the
process tree of ``plexrl up`` (NATS, registry, trainer, inference, orchestrators), sampled
every 0.2 s from /proc (so Linux only).

    .venv/bin/python bench/sweep.py [--runs 8] [--steps 40] [--max-runs 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from services.up.app import ensure_tiny_model

PAGE = os.sysconf("SC_PAGE_SIZE")


def learning_rates(n: int) -> list[float]:
    if n == 1:
        return [2e-3]
    return [float(f"{1e-3 * 8 ** (i / (n - 1)):.3g}") for i in range(n)]


def timed_up(argv: list[str]) -> tuple[float, int]:
    """Run ``plexrl up ARGV``; its wall time and the peak RSS summed over its process tree."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "services", "up", *argv, "--no-live"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc.pid))
            done.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = proc.communicate()
    wall = time.monotonic() - started
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"plexrl up {' '.join(argv)} failed:\n{output}")
    return wall, peak


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and all its descendants, from /proc (Linux)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            parents[int(entry.name)] = int(fields[1])
            rss[int(entry.name)] = int(fields[21]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        pid = frontier.pop()
        children = [c for c, p in parents.items() if p == pid and c not in tree]
        tree.update(children)
        frontier += children
    return sum(rss.get(pid, 0) for pid in tree)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=8, help="learning rates in the sweep")
    parser.add_argument("--steps", type=int, default=40, help="RL steps per run")
    parser.add_argument("--max-runs", type=int, default=8, help="run slots of the sweep's up")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="passed to `plexrl up --device` (trainer and inference); default: their defaults",
    )
    args = parser.parse_args()
    console = Console()
    model = ensure_tiny_model(console)
    lrs = learning_rates(args.runs)
    common = ["--steps", str(args.steps), "--model", str(model)]
    common += ["--device", args.device] if args.device else []
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        root = Path(tmp)
        config = root / "sweep.toml"
        config.write_text(f'max_runs = {args.max_runs}\n[sweep]\nname = "lr"\n"optim.lr" = {lrs}\n')
        console.print(f"sweep of {args.runs} learning rates {lrs}, {args.steps} steps each")
        sweep_wall, sweep_peak = timed_up(
            ["--config", str(config), "--output-dir", str(root / "sweep"), *common]
        )
        console.print(f"  one plexrl up: {sweep_wall:.1f}s")
        one_walls, one_peak = [], 0
        for i, lr in enumerate(lrs):
            single = root / f"single{i}.toml"
            single.write_text(f'envs = ["reverse"]\n[run.optim]\nlr = {lr}\n')
            out = root / f"one{i}"
            single_argv = ["--runs", "1", "--max-runs", "1", "--config", str(single)]
            wall, peak = timed_up([*single_argv, "--output-dir", str(out), *common])
            one_walls.append(wall)
            one_peak = max(one_peak, peak)
            console.print(f"  single run lr={lr:g}: {wall:.1f}s")
    serial = sum(one_walls)
    table = Table(
        title=f"{args.runs} runs x {args.steps} steps (device {args.device or 'default'})"
    )
    for col in ("way", "wall time", "peak RSS (process tree)"):
        table.add_column(col)
    table.add_row("one sweep (plexrl up)", f"{sweep_wall:.1f} s", f"{sweep_peak / 2**20:.0f} MiB")
    table.add_row("one run after another", f"{serial:.1f} s", f"{one_peak / 2**20:.0f} MiB")
    console.print(table)
    console.print(
        f"sweep is {serial / sweep_wall:.2f}x faster, with {sweep_peak / max(one_peak, 1):.2f}x "
        "the peak memory of one single-run plexrl up"
    )


if __name__ == "__main__":
    main()
