"""A sharded trainer under torchrun loses a rank mid-step: torchrun restarts the group, which
resumes from the checkpoints (re-sharding them) and trains every step exactly once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from service_support import eventually, progress_of, publish_batch, submit, weights_events
from trainer_support import Parts, config, make_batch, run_config

from services.bus import Bus
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.trainer.checkpoint import complete_checkpoints, load_checkpoint, read_step_log

RUNS = ("run_a", "run_b")
STEPS = 20
CONFIG = {"rank": 4, "alpha": 8.0, "lr": 1e-2, "eps": 1e-2, "interval": 1}


def _torchrun(url: str, model: Path, out: Path, log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PLEXRL_ACK_WAIT": "3",
        "PLEXRL_COLLECT_MS": "50",
        "GLOO_SOCKET_IFNAME": "lo",
        # a fresh rendezvous store for the restarted group (see services/trainer/distributed.py)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    env.pop("PLEXRL_FAULT", None)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "services",
        "trainer",
        "--sharding",
        "fsdp",
        "--model",
        str(model),
        "--output-dir",
        str(out),
        "--max-runs",
        "2",
        "--max-lora-rank",
        "4",
        "--micro-batch-tokens",
        "64",
        "--threads",
        "1",
        "--nats-url",
        url,
    ]
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2]
        )


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun's worker with ``RANK=rank`` (Linux: read from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def _logged(out: Path) -> int:
    return sum(len(read_step_log(out, run_id)) for run_id in RUNS)


async def test_a_killed_rank_restarts_the_sharded_trainer_and_no_step_is_lost_or_repeated(
    own_nats, own_bus, tmp_path, tiny_dir
):
    out, log = tmp_path / "out", tmp_path / "torchrun.log"
    rbus = await Bus.connect(own_nats.url, "registry")
    registry = Registry(rbus, RegistrySettings(output_dir=out, max_runs=2, scan_interval=3600.0))
    await registry.start()
    batches = {r: [make_batch(r, s, num_samples=4) for s in range(STEPS)] for r in RUNS}
    proc = None
    try:
        for run_id in RUNS:
            await submit(own_bus, run_id, run_config(**CONFIG))
            for batch in batches[run_id]:
                await publish_batch(own_bus, batch)
        proc = _torchrun(own_nats.url, tiny_dir, out, log)

        async def training() -> bool:
            return _logged(out) >= 4

        await eventually(training, timeout=90)
        victim = _rank_pid(proc.pid, 1)
        assert victim is not None, log.read_text()[-3000:]
        os.kill(victim, signal.SIGKILL)

        async def done() -> bool:
            published = [[e.step for e in await weights_events(own_bus, r)][-1:] for r in RUNS]
            return _logged(out) >= len(RUNS) * STEPS and published == [[STEPS]] * len(RUNS)

        await eventually(done, timeout=120)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 60)
            finally:
                if proc.poll() is None:
                    proc.kill()
        await registry.stop()
        await rbus.close()

    text = log.read_text()
    assert "failed (exitcode: -9) local_rank: 1" in text, text[-3000:]
    assert text.count("trainer: run_a on slot") == 2, "started, then resumed after the restart"
    reference = Parts(tiny_dir, max_runs=2, max_rank=4, budget=64)
    checkpoints = {r: load_checkpoint(complete_checkpoints(out, r)[-1][1]) for r in RUNS}
    for run_id in RUNS:
        reference.add_run(checkpoints[run_id].meta["idx"], run_id, config(**CONFIG))
    for step in range(STEPS):
        reference.step({checkpoints[r].meta["idx"]: batches[r][step] for r in RUNS})
    for run_id in RUNS:
        records = read_step_log(out, run_id)
        assert sorted(r["step"] for r in records) == list(range(STEPS)), records
        progress = await progress_of(own_bus, run_id)
        assert progress is not None and progress.step == STEPS
        assert checkpoints[run_id].step == STEPS
        expected = reference.adapter(checkpoints[run_id].meta["idx"])
        for key, value in expected.items():
            torch.testing.assert_close(
                checkpoints[run_id].adapter[key], value, atol=1e-5, rtol=1e-4
            )
    pids = {r["pid"] for run_id in RUNS for r in read_step_log(out, run_id)}
    assert len(pids) == 2, "rank 0 before and after the restart wrote the step log"
