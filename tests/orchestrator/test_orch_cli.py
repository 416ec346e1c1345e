"""``plexrl orchestrator``: exit statuses, and resuming after SIGKILL in a real process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas.config import dump_toml
from schemas.events import EvictRequested
from schemas.subjects import EVICT
from services.bus import Bus, EmbeddedNats
from services.cli import main
from services.config import SettingsError, load_settings
from services.orchestrator.settings import OrchestratorSettings
from services.registry.service import Registry

from .conftest import RUN, RegistryFactory, orch_config
from .replica import ScriptedReplica, announce, eventually, published_steps, read_metrics

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, **overrides: object) -> Path:
    path = tmp_path / "orch.toml"
    path.write_text(dump_toml(orch_config(**overrides).to_dict()))
    return path


def test_usage_errors_exit_2_before_touching_nats(
    tmp_path: Path,
    tiny_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = write_config(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text('env = "reverse"\nbatch_sise = 4\n')
    unreachable = ["--nats-url", "nats://127.0.0.1:1"]
    model = ["--model", str(tiny_dir)]
    cases = {
        "illegal run id": ["run x", "--config", str(good), *model],
        "batch_sise: unknown key": [RUN, "--config", str(bad), *model],
        "--model DIR": [RUN, "--config", str(good)],
        "has no config.json": [RUN, "--config", str(good), "--model", str(tmp_path)],
        # no --config: the run directory's control/orch.toml, which does not exist here
        f"cannot read {tmp_path}/{RUN}/control/orch.toml": [
            RUN,
            "--output-dir",
            str(tmp_path),
            *model,
        ],
    }
    for message, argv in cases.items():
        assert main(["orchestrator", *argv, *unreachable]) == 2, message
        assert message in capsys.readouterr().err
    # A usable command line, but no NATS server there (and no wait for one): status 1 and
    # where it looked.
    monkeypatch.setenv("PLEXRL_CONNECT_WAIT_S", "0")
    argv = ["orchestrator", RUN, "--config", str(good), "--model", str(tiny_dir), *unreachable]
    assert main(argv) == 1
    assert "cannot reach NATS at nats://127.0.0.1:1" in capsys.readouterr().err


async def test_a_rejected_run_exits_2(
    server: EmbeddedNats,
    tmp_path: Path,
    tiny_dir: Path,
    make_registry: RegistryFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    await make_registry(max_async_level=0)
    argv = ["orchestrator", RUN, "--config", str(write_config(tmp_path)), "--model", str(tiny_dir)]
    # In a thread: the command runs its own event loop, as it does in a terminal.
    status = await asyncio.to_thread(main, [*argv, "--nats-url", server.url])
    assert status == 2
    assert "the registry rejected run_orch" in capsys.readouterr().err


@pytest.fixture
def spawn(server: EmbeddedNats, out: Path, tiny_dir: Path, tmp_path: Path) -> Iterator[object]:
    """Start ``python -m services orchestrator`` processes; kill any left at the end."""
    procs: list[subprocess.Popen[str]] = []

    def start(config: Path) -> subprocess.Popen[str]:
        n = len(procs)
        env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # as it is now
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "services", "orchestrator", RUN, "--config", str(config)),
                *("--output-dir", str(out), "--model", str(tiny_dir), "--nats-url", server.url),
                *("--request-timeout", "5"),
            ],
            cwd=REPO,
            env=env,
            stdout=open(tmp_path / f"orch{n}.out", "w"),  # noqa: SIM115 - closed with the process
            stderr=open(tmp_path / f"orch{n}.err", "w"),  # noqa: SIM115
            text=True,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def wait_exit(proc: subprocess.Popen[str], timeout: float) -> int:
    return await asyncio.wait_for(asyncio.to_thread(proc.wait), timeout)


async def test_sigkill_then_sigterm_then_resume_publishes_every_step_once(
    obus: Bus,
    out: Path,
    tmp_path: Path,
    registry: Registry,
    replica: ScriptedReplica,
    spawn: object,
) -> None:
    config = write_config(tmp_path, max_steps=4, max_async_level=1)

    async def steps(expected: list[int]) -> bool:
        return await published_steps(obus, RUN) == expected

    first = spawn(config)  # type: ignore[operator]
    await eventually(lambda: steps([0, 1]), 60)
    first.kill()  # SIGKILL: no chance to clean up
    assert await wait_exit(first, 10) == -signal.SIGKILL

    # Restarted, it resumes at step 2, which waits for policy version 1; SIGTERM ends it cleanly.
    second = spawn(config)  # type: ignore[operator]
    await eventually(lambda: _logged(tmp_path / "orch1.err", "step 2 waits for policy version 1"))
    second.send_signal(signal.SIGTERM)
    assert await wait_exit(second, 15) == 0
    assert "run_orch: stopped; it resumes at step 2" in (tmp_path / "orch1.out").read_text()

    for version in (1, 2):  # the trainer trains on steps 0 and 1 meanwhile
        await announce(obus, RUN, version)
    third = spawn(config)  # type: ignore[operator]
    await eventually(lambda: steps([0, 1, 2, 3]), 60)
    for version in (3, 4):
        await announce(obus, RUN, version)
    assert await wait_exit(third, 30) == 0, (tmp_path / "orch2.err").read_text()[-2000:]
    assert (
        "run_orch: done: 4 steps (2 published by this process)"
        in (tmp_path / "orch2.out").read_text()
    )
    assert await published_steps(obus, RUN) == [0, 1, 2, 3]  # no gap, no step stored twice
    assert [r["step"] for r in read_metrics(out / RUN / "metrics.jsonl")] == [0, 1, 2, 3]


async def test_killed_between_publish_and_metrics_line_the_restart_rebuilds_the_line(
    obus: Bus,
    out: Path,
    tmp_path: Path,
    registry: Registry,
    replica: ScriptedReplica,
    spawn: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The step is on the stream but its metrics line was never written: the restarted
    orchestrator writes it from the batch (marked recovered) and goes on from the next step."""
    config = write_config(tmp_path, max_steps=3, max_async_level=2)
    monkeypatch.setenv("PLEXRL_FAULT", f"orchestrator.publish@{RUN}:1")
    first = spawn(config)  # type: ignore[operator]
    assert await wait_exit(first, 60) == 137, (tmp_path / "orch0.err").read_text()[-2000:]
    assert await published_steps(obus, RUN) == [0, 1]
    assert [r["step"] for r in read_metrics(out / RUN / "metrics.jsonl")] == [0]

    monkeypatch.delenv("PLEXRL_FAULT")
    second = spawn(config)  # type: ignore[operator]
    await eventually(lambda: _published(obus, [0, 1, 2]), 60)
    for version in (1, 2, 3):
        await announce(obus, RUN, version)
    assert await wait_exit(second, 30) == 0, (tmp_path / "orch1.err").read_text()[-2000:]
    rows = read_metrics(out / RUN / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r.get("recovered", False) for r in rows] == [False, True, False]
    recovered = rows[1]
    assert (
        recovered["num_samples"] > 0 and recovered["policy_lag"] == 1 - recovered["policy_version"]
    )
    assert "step 1's metrics line rebuilt from its batch" in (tmp_path / "orch1.err").read_text()


async def _published(bus: Bus, expected: list[int]) -> bool:
    return await published_steps(bus, RUN) == expected


async def _logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


async def test_eviction_exits_3_with_the_reason(
    obus: Bus,
    tmp_path: Path,
    registry: Registry,
    replica: ScriptedReplica,
    spawn: object,
) -> None:
    proc = spawn(write_config(tmp_path, max_steps=5, max_async_level=0))  # type: ignore[operator]

    async def first_step() -> bool:
        return await published_steps(obus, RUN) == [0]

    await eventually(first_step, 60)
    # What `plexrl evict` or the trainer sends; the registry turns it into RunEvicted.
    request = EvictRequested(run_id=RUN, reason="loss diverged at step 1", requested_by="trainer")
    await obus.publish(EVICT, request, msg_id=f"{RUN}/evict/test")
    assert await wait_exit(proc, 15) == 3
    assert f"{RUN} evicted: loss diverged at step 1" in (tmp_path / "orch0.err").read_text()


def test_progress_every_s_is_a_setting_with_an_off_switch() -> None:
    assert load_settings(OrchestratorSettings, environ={}).progress_every_s == 2.0
    off = load_settings(OrchestratorSettings, environ={"PLEXRL_PROGRESS_EVERY_S": "0"})
    assert off.progress_every_s == 0.0
    flag = load_settings(OrchestratorSettings, overrides={"progress_every_s": 0.5}, environ={})
    assert flag.progress_every_s == 0.5
    for bad in ("0.05", "-1", "61"):
        with pytest.raises(SettingsError, match="progress_every_s"):
            load_settings(OrchestratorSettings, environ={"PLEXRL_PROGRESS_EVERY_S": bad})
