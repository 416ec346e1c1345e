"""``plexrl up`` heals itself: the trainer is SIGKILLed mid-run, ``plexrl up`` says so, starts
it again, and both runs still train every step exactly once.

``plexrl up`` runs as a user runs it (a subprocess, its embedded NATS server, ``--no-live``) on
an untrained tiny model with small batches; the trainer is found among up's child processes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.model.tiny import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 6
RUNS = ("run_reverse", "run_copy")
# Small batches and a checkpoint every 2 steps: the restarted trainer resumes from a recent one
# and retrains what came after it from the batches it takes over.
UP_CONFIG = """\
[run]
batch_size = 4
group_size = 4

[run.ckpt]
interval = 2

[run.eval]
interval = 0
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "OTEL_"))}


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of every process whose parent is ``pid`` (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out[int(entry.name)] = cmdline.replace(b"\0", b" ").decode(errors="replace")
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _start_up(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """``plexrl up`` with two runs of STEPS steps on an untrained tiny model: (process, output
    dir, its log), once run_reverse has trained two steps (a first checkpoint)."""
    model = build_tiny_model(tmp_path / "model", seed=0)
    config = tmp_path / "up.toml"
    config.write_text(UP_CONFIG)
    out, log = tmp_path / "out", tmp_path / "up.log"
    argv = ["up", "--runs", "2", "--steps", str(STEPS), "--config", str(config)]
    argv += ["--model", str(model), "--output-dir", str(out), "--no-live", *flags]
    with open(log, "wb") as sink:
        up = subprocess.Popen(
            [sys.executable, "-m", "services", *argv],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=_clean_env(),
        )
    deadline = time.monotonic() + 180
    while len(_lines(out / "run_reverse" / "trainer_steps.jsonl")) < 2:
        if up.poll() is not None or time.monotonic() > deadline:
            _stop(up)
            raise AssertionError(f"no checkpoint, or plexrl up exited early:\n{log.read_text()}")
        time.sleep(0.2)
    return up, out, log


def _stop(up: subprocess.Popen[bytes]) -> None:
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)  # plexrl up stops its children on the way out
        up.wait(timeout=60)


def _trainer_of(up: subprocess.Popen[bytes]) -> int:
    (trainer,) = [p for p, cmd in _children(up.pid).items() if " services trainer " in cmd]
    return trainer


def _every_step_once(out: Path) -> None:
    for run in RUNS:
        metrics = [m["step"] for m in _lines(out / run / "metrics.jsonl")]
        assert metrics == list(range(STEPS)), (run, metrics)
        trained = [t["step"] for t in _lines(out / run / "trainer_steps.jsonl")]
        assert sorted(trained) == list(range(STEPS)), (run, trained)  # each step once


def test_up_restarts_a_killed_trainer_and_every_step_is_trained_once(tmp_path: Path) -> None:
    up, out, log = _start_up(tmp_path)
    try:
        trainer = _trainer_of(up)
        os.kill(trainer, signal.SIGKILL)
        # the kill lands mid-run: the last steps can only be trained by the restarted trainer
        assert all(len(_lines(out / run / "trainer_steps.jsonl")) < STEPS for run in RUNS)
        up.wait(timeout=240)
    finally:
        _stop(up)
    said = log.read_text()
    assert up.returncode == 0, said

    assert f"plexrl up: trainer (pid {trainer}) killed by SIGKILL; restarting it in 1 s" in said
    restarted = re.search(r"plexrl up: trainer restarted \(pid (\d+), restart 1\)", said)
    assert restarted is not None, said
    assert int(restarted.group(1)) != trainer
    assert "plexrl up: services: trainer restarted once (last killed by SIGKILL)" in said
    assert not _alive(int(restarted.group(1)))  # stopped with everything else
    marker = "=== plexrl up: restart 1 after the process killed by SIGKILL"
    before, _, after = (out / "logs" / "trainer.log").read_text().partition(marker)
    assert after, before[-2000:]
    # from the checkpoint it found (steps 0 and 1 at least), not from scratch
    assert re.search(r"run_reverse on slot \d+ resumed at step [2-9]", after), after

    _every_step_once(out)
    summary = json.loads((out / "summary.json").read_text())
    assert {run: summary[run]["status"] for run in RUNS} == dict.fromkeys(RUNS, "done")


def test_up_kills_and_restarts_a_hung_trainer(tmp_path: Path) -> None:
    """A trainer that stops (SIGSTOP: alive, silent) misses its health pings, is killed as hung
    and restarted; the runs finish with every step trained once."""
    up, out, log = _start_up(tmp_path, "--health-interval-s", "1", "--health-misses", "3")
    trainer = 0
    try:
        trainer = _trainer_of(up)
        os.kill(trainer, signal.SIGSTOP)
        assert all(len(_lines(out / run / "trainer_steps.jsonl")) < STEPS for run in RUNS)
        up.wait(timeout=240)
    finally:
        _stop(up)
        if trainer and _alive(trainer):
            os.kill(trainer, signal.SIGKILL)
    said = log.read_text()
    assert up.returncode == 0, said
    assert (
        f"plexrl up: trainer (pid {trainer}) did not answer 3 health pings in a row (1 s apart): "
        "hung, or cut off from NATS; killing it" in said
    ), said
    assert f"plexrl up: trainer (pid {trainer}) killed by SIGKILL; restarting it" in said, said
    assert re.search(r"plexrl up: trainer restarted \(pid \d+, restart 1\)", said), said
    assert not _alive(trainer)
    _every_step_once(out)
