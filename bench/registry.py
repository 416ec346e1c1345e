"""How fast the registry discovers runs and absorbs submits, on its own nats-server.

- discovery: ``--runs`` run directories (default 1,000), each with a valid ``control/orch.toml``,
  discovered by a starting registry: scan, validation (pydantic + hooks), KV record, publish of
  RunDiscovered with its message id, KV ``last_published``; against a bare directory scan (the
  same ``scandir`` and ``stat`` calls, nothing else) measured in the same run, as a ratio; also
  a rescan that finds nothing new, which is what the periodic scan costs in steady state;
- submits: ``--submits`` RunSubmitted events (default 500) published back to back, each
  awaiting its PubAck, timed from the first publish until the last RunDiscovered is on the
  stream. Each submit also writes ``orch.toml`` atomically (with fsync).

Both run twice: on the embedded server of ``plexrl up`` (``EmbeddedNats``, which fsyncs every
JetStream write, so a crash loses nothing acknowledged) and on a nats-server with JetStream's
default sync interval. Every discovery costs three acknowledged writes in order (KV record,
RunDiscovered, ``last_published``), so on the first the disk's fsync latency dominates.

    .venv/bin/python bench/registry.py [--runs 1000] [--submits 500]

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from schemas import subjects as sj
from schemas.config import OrchConfig, dump_toml
from schemas.events import RunSubmitted
from services.bus import Bus, EmbeddedNats, find_nats_server, free_port
from services.registry.discovery import scan_output_dir
from services.registry.service import Registry
from services.registry.settings import RegistrySettings

CONFIG = OrchConfig(env="reverse", max_steps=20, batch_size=4, group_size=4)


@contextlib.contextmanager
def nats_server(store_dir: Path, fsync: bool) -> Iterator[str]:
    """The embedded server (fsync on every write), or a plain one with default sync."""
    if fsync:
        with EmbeddedNats(store_dir=store_dir) as server:
            yield server.url
        return
    store_dir.mkdir(parents=True)
    port = free_port()
    conf = store_dir / "nats.conf"
    conf.write_text(f'jetstream {{\n  store_dir: "{store_dir}"\n}}\n')
    cmd = [find_nats_server(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait()


def bare_scan(output_dir: Path) -> int:
    """The floor: list run_* and stat each one's orch.toml and evicted.txt."""
    found = 0
    for entry in os.scandir(output_dir):
        if entry.name.startswith("run_") and entry.is_dir(follow_symlinks=False):
            control = os.path.join(entry.path, "control")
            try:
                os.stat(os.path.join(control, "orch.toml"))
                found += 1
            except FileNotFoundError:
                continue
            os.path.exists(os.path.join(control, "evicted.txt"))
    return found


async def count_discovered(bus: Bus) -> int:
    info = await bus.js.stream_info(sj.RUNS_STREAM, subjects_filter=sj.DISCOVERED)
    return int((info.state.subjects or {}).get(sj.DISCOVERED, 0))


async def bench_discovery(root: Path, n: int, fsync: bool) -> dict[str, float]:
    out = root / f"discovery-{fsync}"
    text = dump_toml(CONFIG.to_dict())
    for i in range(n):
        control = out / f"run_{i:05d}" / "control"
        control.mkdir(parents=True)
        (control / "orch.toml").write_text(text)
    bare = min(_timed(lambda: bare_scan(out)) for _ in range(5))
    scan_only = min(_timed(lambda: scan_output_dir(out)) for _ in range(5))
    with nats_server(root / f"nats-discovery-{fsync}", fsync) as url:
        bus = await Bus.connect(url, "registry")
        settings = RegistrySettings(output_dir=out, max_runs=n, scan_interval=3600)
        registry = Registry(bus, settings)
        t0 = time.perf_counter()
        await registry.start()  # the first scan discovers everything before start returns
        discovery = time.perf_counter() - t0
        assert await count_discovered(bus) == n
        t0 = time.perf_counter()
        await registry.scan()
        rescan = time.perf_counter() - t0
        assert await count_discovered(bus) == n
        await registry.stop()
        await bus.close()
    return {"bare": bare, "scan_only": scan_only, "discovery": discovery, "rescan": rescan}


async def bench_submits(root: Path, n: int, fsync: bool) -> dict[str, float]:
    with nats_server(root / f"nats-submits-{fsync}", fsync) as url:
        reg_bus = await Bus.connect(url, "registry")
        out = root / f"submits-{fsync}"
        settings = RegistrySettings(output_dir=out, max_runs=n, scan_interval=3600)
        registry = Registry(reg_bus, settings)
        await registry.start()
        client = await Bus.connect(url, "bench")
        config = CONFIG.to_dict()
        t0 = time.perf_counter()
        for i in range(n):
            event = RunSubmitted(run_id=f"run_s{i:05d}", config=config)
            await client.publish(sj.SUBMIT, event, msg_id=f"bench/{i}")
        published = time.perf_counter() - t0
        while await count_discovered(client) < n:
            await asyncio.sleep(0.01)
        total = time.perf_counter() - t0
        await registry.stop()
        await client.close()
        await reg_bus.close()
    return {"published": published, "total": total}


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1000, help="run directories to discover")
    parser.add_argument("--submits", type=int, default=500, help="RunSubmitted events to absorb")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    n, m = args.runs, args.submits
    rows: list[tuple[str, str, str]] = []
    with tempfile.TemporaryDirectory(prefix="plexrl-bench-registry-") as tmp:
        results = {}
        for fsync in (True, False):
            root = Path(tmp)
            results[fsync] = (
                await bench_discovery(root, n, fsync),
                await bench_submits(root, m, fsync),
            )
    (d1, s1), (d0, s0) = results[True], results[False]
    rows.append((f"bare directory scan, {n} runs (baseline)", _ms(d1["bare"]), _ms(d0["bare"])))
    rows.append(
        (f"registry's scan_output_dir alone, {n} runs", _ms(d1["scan_only"]), _ms(d0["scan_only"]))
    )
    rows.append(
        (
            f"discovery of {n} runs (scan + validation + KV + publish)",
            f"{d1['discovery']:.2f} s ({d1['discovery'] / n * 1e3:.2f} ms/run)",
            f"{d0['discovery']:.2f} s ({d0['discovery'] / n * 1e3:.2f} ms/run)",
        )
    )
    rows.append(
        (
            "discovery / bare scan",
            f"{d1['discovery'] / d1['bare']:.0f}x",
            f"{d0['discovery'] / d0['bare']:.0f}x",
        )
    )
    rows.append((f"rescan with nothing new, {n} runs", _ms(d1["rescan"]), _ms(d0["rescan"])))
    rows.append(
        (
            f"{m} submits published (each awaiting its PubAck)",
            f"{s1['published']:.2f} s",
            f"{s0['published']:.2f} s",
        )
    )
    rows.append(
        (
            f"{m} submits -> {m} RunDiscovered on the stream",
            f"{s1['total']:.2f} s ({m / s1['total']:.0f}/s)",
            f"{s0['total']:.2f} s ({m / s0['total']:.0f}/s)",
        )
    )
    print(f"| registry, {os.cpu_count()} cores | fsync every write (plexrl up) | default sync |")
    print("| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


if __name__ == "__main__":
    asyncio.run(main())
