"""Memory soak: does any process of ``plexrl up`` grow while the runs train?

Starts ``plexrl up`` (``--runs`` demo runs with more steps than fit in the time, the
warm-started tiny model, its embedded NATS server), samples the resident set size of each of its
processes every ``--interval`` seconds from /proc (Linux), and after ``--minutes`` stops it the
way Ctrl-C does. Processes: ``plexrl up`` itself (which drives one orchestrator per run),
``nats-server``, ``registry``, ``inference`` and ``trainer``; a process that ``plexrl up``
restarted is followed under its service's name, and the restart is reported.

For each process the table gives its RSS at the end of the warm-up (``--warmup-minutes``:
imports, first allocations, allocator pools and caches filling up) and at the end, its peak,
and the slope of a least-squares line through the samples after the warm-up, in MiB per hour:
what a leak would show. A slope is an estimate over a short window; compare it with the noise
(``±``: the standard error of the slope). The tiny model trains many steps per second, far more
than a real one, so the slope is also given per 1,000 steps (all runs together, counted from
their ``metrics.jsonl`` the same way): growth that follows the work, not the clock.

    .venv/bin/python bench/soak.py [--minutes 8] [--warmup-minutes 2] [--runs 3] [--interval 5]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from services.up.app import ensure_tiny_model

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 2**20
SERVICES = ("registry", "inference", "trainer")


@dataclass
class Series:
    """The RSS samples of one service: ``(seconds since start, bytes)``, and the pids seen."""

    name: str
    samples: list[tuple[float, int]] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)


def processes() -> dict[int, tuple[int, str, int]]:
    """pid -> (parent pid, command line, resident bytes) of every process, from /proc."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(entry.name)] = (int(fields[1]), cmdline, int(fields[21]) * PAGE)
    return out


def name_of(cmdline: str) -> str | None:
    """Which service a child of ``plexrl up`` runs, from its command line."""
    if "nats-server" in cmdline:
        return "nats-server"
    for service in SERVICES:
        if f" services {service} " in cmdline:
            return service
    return None


def steps_done(out: Path) -> int:
    """Steps recorded so far, over every run (complete lines of the runs' metrics.jsonl)."""
    total = 0
    for path in out.glob("run_*/metrics.jsonl"):
        try:
            total += path.read_bytes().count(b"\n")
        except OSError:
            continue
    return total


def sample(up_pid: int, series: dict[str, Series], t: float) -> None:
    procs = processes()
    found = {"up (orchestrators)": up_pid}
    for pid, (parent, cmdline, _) in procs.items():
        if parent == up_pid and (name := name_of(cmdline)) is not None:
            found[name] = pid
    for name, pid in found.items():
        if pid not in procs:
            continue
        s = series.setdefault(name, Series(name))
        if not s.pids or s.pids[-1] != pid:
            s.pids.append(pid)
        s.samples.append((t, procs[pid][2]))


def slope(points: list[tuple[float, int]], unit: float = MIB) -> tuple[float, float]:
    """Least-squares slope of ``value / unit`` over seconds and its standard error, both per
    hour (MiB per hour for bytes)."""
    n = len(points)
    if n < 3:
        return math.nan, math.nan
    xs = [t for t, _ in points]
    ys = [b / unit for _, b in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    residual = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))
    stderr = math.sqrt(residual / (n - 2) / sxx)
    return b * 3600, stderr * 3600


def soak(args: argparse.Namespace, model: Path, out: Path, console: Console) -> dict[str, Series]:
    """Run ``plexrl up`` for ``--minutes`` and sample it; the series ``steps`` counts steps."""
    config = out.parent / "soak.toml"
    config.write_text(f"[run.ckpt]\ninterval = {args.ckpt_interval}\n")
    argv = ["up", "--runs", str(args.runs), "--steps", "100000", "--model", str(model)]
    argv += ["--config", str(config), "--output-dir", str(out), "--no-live"]
    argv += ["--device", args.device] if args.device else []
    log = out.parent / "up.log"
    with open(log, "wb") as sink:
        up = subprocess.Popen(
            [sys.executable, "-m", "services", *argv], stdout=sink, stderr=subprocess.STDOUT
        )
    series: dict[str, Series] = {}
    started = time.monotonic()
    end = started + args.minutes * 60
    try:
        while (now := time.monotonic()) < end:
            if up.poll() is not None:
                raise SystemExit(f"plexrl up exited early ({up.returncode}):\n{log.read_text()}")
            sample(up.pid, series, now - started)
            series.setdefault("steps", Series("steps")).samples.append(
                (now - started, steps_done(out))
            )
            time.sleep(max(0.0, min(args.interval, end - time.monotonic())))
    finally:
        stopping = time.monotonic()
        if up.poll() is None:
            up.send_signal(signal.SIGINT)  # as Ctrl-C: the runs stop, the services stop in order
            try:
                up.wait(timeout=120)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()
    steps = sum(len((d / "metrics.jsonl").read_text().splitlines()) for d in out.glob("run_*"))
    console.print(
        f"{steps} steps trained over {args.runs} runs; plexrl up stopped "
        f"{time.monotonic() - stopping:.0f} s after Ctrl-C (exit status {up.returncode})"
    )
    return series


def report(series: dict[str, Series], args: argparse.Namespace) -> Table:
    warmup = args.warmup_minutes * 60
    table = Table(
        title=f"RSS of each process over {args.minutes:g} min ({args.runs} runs, samples every "
        f"{args.interval:g} s; slope: least squares after a {args.warmup_minutes:g} min warm-up)"
    )
    steps = [(t, n) for t, n in series["steps"].samples if t >= warmup]
    steps_per_hour, _ = slope(steps, unit=1)
    heads = ("process", "pids", "RSS after warm-up", "RSS at end", "peak", "slope (MiB/h)")
    for col in (*heads, "KiB per 1k steps", "samples"):
        table.add_column(col, justify="left" if col in ("process", "pids") else "right")
    for name in ("up (orchestrators)", "nats-server", *SERVICES):
        s = series.get(name)
        if s is None or not s.samples:
            continue
        after = [(t, b) for t, b in s.samples if t >= warmup]
        rate, noise = slope(after)
        first = after[0][1] if after else s.samples[-1][1]
        table.add_row(
            name,
            ", ".join(map(str, s.pids)) + (" (restarted)" if len(s.pids) > 1 else ""),
            f"{first / MIB:.0f} MiB",
            f"{s.samples[-1][1] / MIB:.0f} MiB",
            f"{max(b for _, b in s.samples) / MIB:.0f} MiB",
            "-" if math.isnan(rate) else f"{rate:+.1f} ± {noise:.1f}",
            "-" if math.isnan(rate) else f"{rate / steps_per_hour * 1024 * 1000:+.0f}",
            str(len(after)),
        )
    table.caption = f"steps after the warm-up: {steps_per_hour:,.0f} per hour over all runs"
    return table


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=8.0, help="how long to run")
    parser.add_argument("--warmup-minutes", type=float, default=2.0, help="left out of slopes")
    parser.add_argument("--runs", type=int, default=3, help="demo runs training at once")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--ckpt-interval", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--model", type=Path, help="default: the warm-started tiny model")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="passed to plexrl up --device")
    parser.add_argument("--json", type=Path, help="also write every sample here")
    args = parser.parse_args()
    if args.warmup_minutes >= args.minutes:
        parser.error("--warmup-minutes must be shorter than --minutes")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough that no column is cut
        console = Console(width=max(console.width, 140))
    model = args.model or ensure_tiny_model(console)
    console.print(f"command: {' '.join(sys.argv)}")
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        series = soak(args, model, Path(tmp) / "out", console)
        log = Path(tmp) / "up.log"
        restarts = [line for line in log.read_text().splitlines() if "restarted (pid" in line]
    console.print(report(series, args))
    for line in restarts:
        console.print(line)
    if args.json:
        data = {name: {"pids": s.pids, "samples": s.samples} for name, s in series.items()}
        args.json.write_text(json.dumps(data) + "\n")


if __name__ == "__main__":
    main()
