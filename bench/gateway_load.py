"""``bench/gateway.py --load``: offered sampling load against served load, latency, errors and the
co-located RL runs' step time.

One ``plexrl up --gateway --runs R`` (nats-server, registry, trainer, inference, the gateway and
R demo RL runs training, the tiny model) serves completions to a raw-asyncio HTTP load
generator: at each level, ``C`` clients each send ``/v1/completions`` back to back (``n``
completions of ``max_tokens`` tokens of the base model), honouring a 429's ``Retry-After`` as the
official clients do, for ``--seconds``. Level 0 (no clients) is the baseline of the same run.

Reported per level: requests offered and served per second, the latency of the served ones
(p50, p99), responses by status, and the runs' seconds per step (their ``metrics.jsonl``,
median of the steps finished during the level) as a ratio to level 0. A plot of the same goes
to ``--plot``.

    .venv/bin/python bench/gateway.py --load [--levels 0,8,32,128,512] [--seconds 20]
        [--rl-runs 2] [--http-share 0.25] [--plot docs/gateway-load.png]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.bus import free_port
from services.model.tiny import build_tiny_model

NAME = "tiny-base"


@dataclass
class Level:
    clients: int
    seconds: float = 0.0
    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    step_s: float | None = None
    steps: int = 0
    errors: dict[int, str] = field(default_factory=dict)
    """the first error body of each status"""

    @property
    def served(self) -> int:
        return self.statuses[200]

    def pct(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Up:
    """``plexrl up --gateway --runs R`` as one process tree, stopped on exit."""

    def __init__(self, root: Path, runs: int, env: dict[str, str]) -> None:
        self.root = root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = root / "out"
        model = build_tiny_model(root / "model", seed=0)
        log = (root / "up.log").open("wb")
        child_env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")} | env
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "services", "up", "--gateway", "--runs", str(runs)),
                *("--steps", "100000", "--gateway-port", str(self.port), "--no-live"),
                *("--model", str(model), "--output-dir", str(self.out), "--model-name", NAME),
            ],
            env=child_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def wait(self, runs: int, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"plexrl up exited; see {self.root / 'up.log'}")
            if len(self.step_times()) >= runs and min(len(t) for t in self.step_times()) >= 3:
                return
            time.sleep(1.0)
        raise SystemExit(f"the runs made no steps; see {self.root / 'up.log'}")

    def step_times(self) -> list[list[float]]:
        """Each run's step finish times (unix seconds), from its metrics.jsonl."""
        times = []
        for path in sorted(self.out.glob("run_*/metrics.jsonl")):
            lines = path.read_text().splitlines()
            times.append([json.loads(line)["time"] for line in lines if line.strip()])
        return times

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def drive(url: str, level: Level, seconds: float, n: int, max_tokens: int) -> None:
    """``level.clients`` clients sending completions back to back for ``seconds``."""
    stop_at = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=level.clients + 1)
    body = {"model": NAME, "prompt": "abc", "max_tokens": max_tokens, "n": n}
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as client:

        async def one_client() -> None:
            while time.monotonic() < stop_at:
                started = time.monotonic()
                level.sent += 1
                try:
                    response = await client.post("/v1/completions", json=body)
                except httpx.HTTPError:
                    level.statuses[0] += 1
                    continue
                level.statuses[response.status_code] += 1
                if response.status_code != 200:
                    level.errors.setdefault(response.status_code, response.text[:300])
                if response.status_code == 200:
                    level.latencies.append(time.monotonic() - started)
                elif response.status_code == 429:
                    pause = float(response.headers.get("retry-after", "1"))
                    await asyncio.sleep(min(pause, max(0.0, stop_at - time.monotonic())))

        await asyncio.gather(*(one_client() for _ in range(level.clients)))


def measure(up: Up, clients: int, seconds: float, n: int, max_tokens: int) -> Level:
    level = Level(clients)
    started = time.time()
    if clients:
        asyncio.run(drive(up.url, level, seconds, n, max_tokens))
    else:
        time.sleep(seconds)
    ended = time.time()
    level.seconds = ended - started
    gaps = []
    for times in up.step_times():
        inside = [t for t in times if started <= t <= ended]
        level.steps += len(inside)
        before = [t for t in times if t < started][-1:]
        points = before + inside
        gaps += [b - a for a, b in itertools.pairwise(points)]
    level.step_s = statistics.median(gaps) if gaps else None
    return level


def report(levels: list[Level], args: Any) -> None:
    base = levels[0].step_s
    print(
        f"\nCPU, tiny model, {args.rl_runs} RL runs training; completions of n={args.n} x "
        f"{args.max_tokens} tokens; http_share {args.http_share}; {args.seconds:g} s per level\n"
    )
    print("| clients | offered req/s | served req/s | p50 | p99 | responses by status | "
          "run step | vs no load |")  # fmt: skip
    print("| ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for lv in levels:
        statuses = ", ".join(f"{s or 'failed'}: {c}" for s, c in sorted(lv.statuses.items()))
        step = f"{lv.step_s:.2f} s" if lv.step_s else "-"
        ratio = f"{lv.step_s / base:.2f}x" if lv.step_s and base else "-"
        p50 = f"{lv.pct(0.5) * 1000:.0f} ms" if lv.latencies else "-"
        p99 = f"{lv.pct(0.99) * 1000:.0f} ms" if lv.latencies else "-"
        print(
            f"| {lv.clients} | {lv.sent / lv.seconds:.1f} | {lv.served / lv.seconds:.1f} | {p50} | "
            f"{p99} | {statuses or '-'} | {step} | {ratio} |"
        )
    for lv in levels:
        for status, text in sorted(lv.errors.items()):
            print(f"\n{lv.clients} clients, first {status}: {text}")


def plot(levels: list[Level], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = [lv for lv in levels if lv.clients]
    base = levels[0].step_s or float("nan")
    xs = [lv.clients for lv in loaded]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.plot(xs, [lv.sent / lv.seconds for lv in loaded], "o-", label="offered")
    left.plot(xs, [lv.served / lv.seconds for lv in loaded], "s-", label="served (200)")
    left.plot(xs, [lv.statuses[429] / lv.seconds for lv in loaded], "^-", label="429")
    left.set(xscale="log", yscale="symlog", xlabel="concurrent clients", ylabel="requests / s")
    left.legend()
    right.plot(xs, [(lv.step_s or float("nan")) / base for lv in loaded], "o-", label="step time")
    right.plot(xs, [lv.pct(0.99) for lv in loaded], "s--", label="p99 latency (s)")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xscale="log", xlabel="concurrent clients", ylabel="x no load / seconds")
    right.legend()
    fig.suptitle("plexrl gateway under sampling load, RL runs training beside it")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def run(args: Any) -> None:
    env = {"PLEXRL_HTTP_SHARE": str(args.http_share), "PLEXRL_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="plexrl-bench-load-") as tmp:
        up = Up(Path(tmp), args.rl_runs, env)
        try:
            up.wait(args.rl_runs)
            levels = [
                measure(up, clients, args.seconds, args.n, args.max_tokens)
                for clients in args.levels
            ]
        finally:
            up.close()
    report(levels, args)
    if args.plot:
        plot(levels, Path(args.plot))
