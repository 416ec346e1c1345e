"""A trainer restarted after SIGKILL takes over its predecessor's unacknowledged batches at once.

The consumer's ack_wait stays at its default (300 s): the batches the killed trainer had fetched
(every remaining step of the run) and the steps it trained after its last checkpoint come back
only when the new trainer takes the consumer over, so the run finishes within a minute instead of
standing still for five. Every step is still trained exactly once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from service_support import eventually, progress_of, publish_batch, submit
from trainer_support import make_batch, run_config

from schemas.subjects import ROLLOUTS_STREAM
from services.bus import Bus
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.trainer.checkpoint import read_step_log

STEPS = 12


def _trainer(url: str, model: Path, out: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PLEXRL_UNKNOWN_RUN_HOLD": "0.5", "PLEXRL_COLLECT_MS": "0"}
    for name in ("PLEXRL_FAULT", "PLEXRL_ACK_WAIT"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "services", "trainer", "--model", str(model)]
    cmd += ["--output-dir", str(out), "--max-runs", "1", "--max-lora-rank", "4"]
    cmd += ["--micro-batch-tokens", "64", "--threads", "1", "--nats-url", url]
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2]
        )


async def _step_at_least(bus: Bus, step: int) -> bool:
    progress = await progress_of(bus, "run_a")
    return progress is not None and progress.step >= step


async def _logged_all(out: Path) -> bool:
    return len(read_step_log(out, "run_a")) >= STEPS


async def _all_acked(bus: Bus) -> bool:
    info = await bus.js.consumer_info(ROLLOUTS_STREAM, "trainer")
    return (info.num_ack_pending, info.num_pending) == (0, 0)


async def test_a_restarted_trainer_does_not_wait_out_the_ack_wait(
    own_nats, own_bus, tmp_path, tiny_dir
):
    out, log = tmp_path / "out", tmp_path / "trainer.log"
    bus = own_bus
    rbus = await Bus.connect(own_nats.url, "registry")
    registry = Registry(rbus, RegistrySettings(output_dir=out, max_runs=1, scan_interval=3600.0))
    await registry.start()
    proc = None
    try:
        await submit(bus, "run_a", run_config(rank=4, interval=4, lr=1e-2))
        for step in range(STEPS):
            await publish_batch(bus, make_batch("run_a", step, num_samples=3))
        proc = _trainer(own_nats.url, tiny_dir, out, log)
        # past the checkpoint of step 4, before the one of step 8: steps 4.. are not committed
        await eventually(lambda: _step_at_least(bus, 5), timeout=90)
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 30)
        info = await bus.js.consumer_info(ROLLOUTS_STREAM, "trainer")
        assert info.config.ack_wait == 300.0
        assert info.num_ack_pending > 0  # held by the dead trainer

        proc = _trainer(own_nats.url, tiny_dir, out, log)
        # well inside the 300 s ack_wait
        await eventually(lambda: _logged_all(out), timeout=60)
        steps = sorted(r["step"] for r in read_step_log(out, "run_a"))
        assert steps == list(range(STEPS)), steps
        assert "took over consumer trainer" in log.read_text()
        # the last checkpoint's acks follow its step log lines
        await eventually(lambda: _all_acked(bus), timeout=30)
    finally:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.to_thread(proc.wait, 60)
        await registry.stop()
        await rbus.close()
