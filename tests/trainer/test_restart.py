"""Every step of every run is trained exactly once across trainer crashes.

A trainer subprocess is killed again and again: at each window of the commit sequence
(checkpoint -> step log -> WeightsReady -> progress -> ack, via PLEXRL_FAULT) and
once by SIGKILL from outside at an arbitrary moment. Every restart resumes from the checkpoints
and the redelivered batches. The step log lists each trained step once it is committed, so a
step trained twice shows up twice, and a step skipped never shows up (and the run stalls).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from service_support import eventually, progress_of, publish_batch, submit, weights_events
from trainer_support import make_batch, num_tokens, run_config

from schemas.subjects import ROLLOUTS_STREAM
from services.bus import Bus
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.trainer.checkpoint import complete_checkpoints, read_step_log

RUNS = ("run_a", "run_b")
STEPS = 12


def _trainer(url: str, model: Path, out: Path, log: Path, crash: str | None) -> subprocess.Popen:
    env = {
        **os.environ,
        "PLEXRL_ACK_WAIT": "1.5",
        "PLEXRL_UNKNOWN_RUN_HOLD": "0.5",
        "PLEXRL_COLLECT_MS": "0",
    }
    env.pop("PLEXRL_FAULT", None)
    if crash:
        env["PLEXRL_FAULT"] = f"trainer.{crash}"
    cmd = [
        sys.executable,
        "-m",
        "services",
        "trainer",
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


def _committed(out: Path, run_id: str) -> int:
    """Steps the run's newest complete checkpoint holds."""
    found = complete_checkpoints(out, run_id)
    return found[-1][0] if found else 0


def _logged(out: Path) -> int:
    return sum(len(read_step_log(out, run_id)) for run_id in RUNS)


async def _wait_exit(proc: subprocess.Popen, log: Path, timeout: float = 90.0) -> int:
    try:
        # in a thread: the registry shares this event loop and must keep serving
        return await asyncio.to_thread(proc.wait, timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"trainer did not exit:\n{log.read_text()[-3000:]}") from None


async def test_sigkill_and_crashes_at_every_commit_point_train_each_step_once(
    own_nats, own_bus, tmp_path, tiny_dir
):
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    bus = own_bus
    rbus = await Bus.connect(own_nats.url, "registry")
    registry = Registry(rbus, RegistrySettings(output_dir=out, max_runs=2, scan_interval=3600.0))
    await registry.start()
    try:
        batches = {r: [make_batch(r, s, num_samples=3) for s in range(STEPS)] for r in RUNS}
        for run_id in RUNS:
            await submit(bus, run_id, run_config(rank=4, interval=1, lr=1e-2))
            for batch in batches[run_id]:
                await publish_batch(bus, batch)

        # crash right after each point of the commit sequence, each time one step past where
        # the run furthest behind resumes, so that the crash is sure to come
        crashes = []
        for point in ("checkpoint", "publish", "progress", "train"):
            run_id = min(RUNS, key=lambda r: _committed(out, r))
            crashes.append((point, run_id, _committed(out, run_id) + 1))
            proc = _trainer(own_nats.url, tiny_dir, out, log, "{}@{}:{}".format(*crashes[-1]))
            assert await _wait_exit(proc, log) == 137, log.read_text()[-3000:]

        # and once from outside, whatever the trainer is doing
        proc = _trainer(own_nats.url, tiny_dir, out, log, None)
        target = min(_logged(out) + 3, len(RUNS) * STEPS)
        await eventually(lambda: _at_least(out, target), timeout=90)
        proc.send_signal(signal.SIGKILL)
        assert await _wait_exit(proc, log) == -signal.SIGKILL

        proc = _trainer(own_nats.url, tiny_dir, out, log, None)
        try:
            await eventually(lambda: _at_least(out, len(RUNS) * STEPS), timeout=90)
            await eventually(lambda: _all_published(bus), timeout=30)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await _wait_exit(proc, log) == 0, log.read_text()[-3000:]

        for run_id in RUNS:
            records = read_step_log(out, run_id)
            assert sorted(r["step"] for r in records) == list(range(STEPS)), records
            # one announcement per version (the stream keeps the newest 8 per run)
            announced = [e.step for e in await weights_events(bus, run_id)]
            assert announced == list(range(STEPS - 7, STEPS + 1))
            progress = await progress_of(bus, run_id)
            assert progress.step == STEPS
            assert progress.total_samples == 3 * STEPS
            assert progress.total_tokens == sum(num_tokens(b) for b in batches[run_id])
            assert complete_checkpoints(out, run_id)[-1][0] == STEPS
        # the crash between the checkpoint and the step log was repaired from the checkpoint
        _, run_id, step = crashes[0]
        recovered = [r for r in read_step_log(out, run_id) if r.get("recovered")]
        assert [r["step"] for r in recovered] == [step]
        assert len({r["pid"] for run in RUNS for r in read_step_log(out, run) if "pid" in r}) >= 4
        info = await bus.js.consumer_info(ROLLOUTS_STREAM, "trainer")
        assert (info.num_ack_pending, info.num_pending) == (0, 0)
    finally:
        await registry.stop()
        await rbus.close()


async def _at_least(out: Path, count: int) -> bool:
    return _logged(out) >= count


async def _all_published(bus: Bus) -> bool:
    for run_id in RUNS:
        if [e.step for e in await weights_events(bus, run_id)][-1:] != [STEPS]:
            return False
    return True
