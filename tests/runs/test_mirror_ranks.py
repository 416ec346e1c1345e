"""Two gloo ranks follow the same stream and apply exactly the same events and hook calls.

Two processes (rank_worker.py) join a gloo group on loopback and call
``RunMirror.synchronize_state`` in a loop at different paces while this test keeps publishing
lifecycle events; rank 1's event loop is blocked between calls, as by a training step, so it is
behind rank 0 and must wait for rank 0's sequence.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schemas import subjects as sj
from schemas.config import OrchConfig
from schemas.events import RunDiscovered, RunEvicted, RunForgotten
from services.bus import Bus, EmbeddedNats, free_port

pytest.importorskip("torch.distributed")

WORKER = Path(__file__).with_name("rank_worker.py")
MAX_RUNS = 4


async def _publish_churn(bus: Bus, n: int, seed: int = 3) -> dict[int, str]:
    """Publish ``n`` lifecycle events a registry could have sent; return the final state."""
    rng = random.Random(seed)
    held: dict[int, str] = {}
    config = OrchConfig(env="copy").to_dict()
    for i in range(n):
        free = [j for j in range(MAX_RUNS) if j not in held]
        if free and (not held or rng.random() < 0.6):
            idx = min(free)
            run_id = f"run_{rng.randrange(6)}"  # ids come back after eviction
            if run_id in held.values():
                run_id = f"run_new{i}"
            held[idx] = run_id
            await bus.publish(sj.DISCOVERED, RunDiscovered(run_id=run_id, idx=idx, config=config))
        else:
            idx = rng.choice(sorted(held))
            run_id = held.pop(idx)
            if rng.random() < 0.5:
                event: RunEvicted | RunForgotten = RunEvicted(run_id=run_id, idx=idx, reason="r")
                await bus.publish(sj.EVICTED, event)
            else:
                await bus.publish(sj.FORGOTTEN, RunForgotten(run_id=run_id, idx=idx))
        await asyncio.sleep(0.008)
    return held


async def test_two_ranks_apply_the_same_events_while_events_keep_arriving(
    rbus: Bus, server: EmbeddedNats, tmp_path: Path
) -> None:
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        GLOO_SOCKET_IFNAME="lo",
        WORLD_SIZE="2",
    )
    procs = []
    for rank in (0, 1):
        log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
        procs.append(
            (
                subprocess.Popen(
                    [sys.executable, str(WORKER), server.url, str(tmp_path)],
                    env=env | {"RANK": str(rank)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                ),
                log,
            )
        )
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in (0, 1)):
            assert all(p.poll() is None for p, _ in procs), _logs(tmp_path)
            assert time.monotonic() < deadline, _logs(tmp_path)
            await asyncio.sleep(0.05)
        final = await _publish_churn(rbus, 120)
        (tmp_path / "done").touch()
        for p, _ in procs:
            assert await asyncio.to_thread(p.wait, 60) == 0, _logs(tmp_path)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["log"] == rank1["log"]  # same calls, same counts, same hooks, same order
    assert rank0["runs"] == rank1["runs"] == {str(i): r for i, r in final.items()}
    counts = [c[1] for c in rank1["log"] if c[0] == "sync"]
    assert sum(counts) == 120 and sum(n > 0 for n in counts) >= 5  # applied over many calls
    assert rank1["waited"] >= 1 and rank0["waited"] == 0
    kinds = [c[0] for c in rank0["log"]]
    assert kinds.count("creation") > 0 and kinds.count("deletion") > 0


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- rank {r}\n" + (tmp_path / f"rank{r}.log").read_text(errors="replace")[-2000:]
        for r in (0, 1)
    )
