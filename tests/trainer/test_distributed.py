"""Two gloo ranks train the same adapters, and the same ones a single process trains."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import torch
from service_support import publish_batch, submit
from trainer_support import Parts, config, make_batch, run_config

from services.bus import Bus, free_port
from services.registry.service import Registry
from services.registry.settings import RegistrySettings

RUNS = ("run_a", "run_b")
STEPS = 3
# eps well above the gradients' scale makes AdamW's update proportional to the gradient, so a
# gradient off by a factor (a mean over ranks instead of a sum) changes the result.
CONFIG = {"rank": 4, "alpha": 8.0, "lr": 1e-2, "eps": 1e-2, "interval": 1}


def _batches() -> dict[str, list]:
    return {r: [make_batch(r, s, num_samples=7) for s in range(STEPS)] for r in RUNS}


async def test_two_gloo_ranks_end_with_identical_adapters(own_nats, own_bus, tmp_path, tiny_dir):
    out = tmp_path / "out"
    rbus = await Bus.connect(own_nats.url, "registry")
    registry = Registry(rbus, RegistrySettings(output_dir=out, max_runs=2, scan_interval=3600.0))
    await registry.start()
    batches = _batches()
    try:
        for run_id in RUNS:
            await submit(own_bus, run_id, run_config(**CONFIG))
        for step in range(STEPS):
            for run_id in RUNS:
                await publish_batch(own_bus, batches[run_id][step])
        port = free_port()
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": "2",
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONPATH": str(Path(__file__).parents[2]),
            }
            log = open(tmp_path / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed below
            cmd = [
                sys.executable,
                str(Path(__file__).with_name("dist_worker.py")),
                own_nats.url,
                str(tiny_dir),
                str(out),
                str(tmp_path / f"rank{rank}.pt"),
                str(STEPS),
            ]
            procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
        for proc, log in procs:
            try:
                # waited for in a thread: the registry shares this event loop
                code = await asyncio.to_thread(proc.wait, 150)
            finally:
                if proc.poll() is None:
                    proc.kill()
                log.close()
            assert code == 0, (tmp_path / "rank0.log").read_text()[-3000:] + (
                tmp_path / "rank1.log"
            ).read_text()[-3000:]
    finally:
        await registry.stop()
        await rbus.close()

    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert rank0["_steps"] == rank1["_steps"] >= STEPS
    assert set(rank0) == set(rank1) == {*RUNS, "_steps"}
    reference = Parts(tiny_dir, max_runs=2, max_rank=4, budget=64)
    for run_id in RUNS:
        reference.add_run(rank0[run_id]["idx"], run_id, config(**CONFIG))
    for step in range(STEPS):
        reference.step({rank0[r]["idx"]: batches[r][step] for r in RUNS})
    for run_id in RUNS:
        a, b = rank0[run_id]["adapter"], rank1[run_id]["adapter"]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"{run_id}: ranks differ"
        expected = reference.adapter(rank0[run_id]["idx"])
        for key, value in expected.items():
            torch.testing.assert_close(a[key], value, atol=1e-5, rtol=1e-4)
