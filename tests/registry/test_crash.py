"""The registry killed between writing a file (or its KV record) and publishing, then restarted.

Each case runs ``python -m services registry`` as a real process with
``PLEXRL_FAULT`` set, so it exits with status 137 (as after SIGKILL) right after
the chosen step, restarts it without the variable, and checks convergence: every run announced
exactly once on the stream, no index ever held by two runs, the table and the files agreeing.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from schemas import subjects as sj
from schemas.config import parse_orch_config
from schemas.events import (
    EvictRequested,
    RunConfigInvalid,
    RunDiscovered,
    RunEvicted,
    RunSubmitted,
)
from services.bus import Bus, EmbeddedNats

from .helpers import VALID_TOML, events_on, eventually, table, write_orch

REPO = Path(__file__).resolve().parents[2]


class RegistryProcess:
    """``python -m services registry`` against the test's server, its output in a log file."""

    def __init__(
        self, url: str, out: Path, log: Path, crash: str | None = None, scan_interval: float = 0.2
    ) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
        if crash:
            env["PLEXRL_FAULT"] = f"registry.{crash}"
        cmd = [sys.executable, "-m", "services", "registry", "--nats-url", url]
        cmd += ["--output-dir", str(out), "--max-runs", "2"]
        cmd += ["--scan-interval", str(scan_interval)]
        self.log = log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(
                f"registry did not exit:\n{self.log.read_text()[-3000:]}"
            ) from None

    def terminate(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait()


@pytest.fixture
def processes() -> Iterator[list[RegistryProcess]]:
    started: list[RegistryProcess] = []
    yield started
    for p in started:
        if p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait()


async def _counts(bus: Bus, subject: str, event_type: type) -> collections.Counter[str]:
    return collections.Counter(e.run_id for e in await events_on(bus, subject, event_type))


async def _assert_converged(bus: Bus, out: Path) -> None:
    records = await table(bus)
    active = {r.run_id: r.idx for r in records.values() if r.status == "active"}
    assert len(set(active.values())) == len(active), active  # indices unique
    discovered = await events_on(bus, sj.DISCOVERED, RunDiscovered)
    counts = collections.Counter((e.run_id, e.idx) for e in discovered)
    assert all(n == 1 for n in counts.values()), counts
    for rec in records.values():
        assert not rec.owes_event, rec  # everything owed was published
        evicted_file = out / rec.run_id / "control" / "evicted.txt"
        assert evicted_file.exists() == (rec.status == "evicted"), rec.run_id


async def _assert_crashed_where_asked(bus: Bus, out: Path, crash: str) -> None:
    """The state the killed process left: the step done, the next one not."""
    records = await table(bus)
    discovered = dict(await _counts(bus, sj.DISCOVERED, RunDiscovered))
    evicted = dict(await _counts(bus, sj.EVICTED, RunEvicted))
    control = out / crash.split("@")[1].split(":")[0] / "control"
    match crash:
        case "orch_toml@run_s":
            assert (control / "orch.toml").exists() and "run_s" not in records
            assert discovered == {}
        case "kv@run_b:active":  # one batch: both records written, nothing published yet
            assert (records["run_b"].status, records["run_b"].idx) == ("active", 1)
            assert records["run_a"].owes_event and records["run_b"].owes_event
            assert discovered == {}
        case "publish@run_a:active":  # both published, neither marked
            assert records["run_a"].owes_event and records["run_b"].owes_event
            assert discovered == {"run_a": 1, "run_b": 1}
        case "error_txt@run_bad":
            assert (control / "config_validation_error.txt").exists() and records == {}
            assert await _counts(bus, sj.INVALID, RunConfigInvalid) == {}
        case "evicted_txt@run_a":
            assert (control / "evicted.txt").exists() and records["run_a"].status == "active"
            assert evicted == {}
        case "kv@run_a:evicted":
            assert records["run_a"].status == "evicted" and records["run_a"].owes_event
            assert evicted == {}
        case "kv@run_c:active":
            assert (records["run_c"].status, records["run_c"].idx) == ("active", 0)
            assert evicted == {"run_a": 1} and "run_c" not in discovered
        case _:
            raise AssertionError(crash)


# crash point -> what the test does: submit a run, let the scan find runs, write an invalid
# config, or evict a running run
CASES = {
    "orch_toml@run_s": "submit",
    "kv@run_b:active": "scan",
    "publish@run_a:active": "scan",
    "error_txt@run_bad": "invalid",
    "evicted_txt@run_a": "evict",
    "kv@run_a:evicted": "evict",
    "kv@run_c:active": "evict",
}


@pytest.mark.parametrize("crash", list(CASES))
async def test_sigkill_between_write_and_publish_converges_after_restart(
    tmp_path: Path, processes: list[RegistryProcess], crash: str
) -> None:
    scenario = CASES[crash]
    out = tmp_path / "out"
    log = tmp_path / "registry.log"
    with EmbeddedNats(store_dir=tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, "test")
        try:
            if scenario == "submit":
                config = parse_orch_config(VALID_TOML).to_dict()
                await bus.publish(sj.SUBMIT, RunSubmitted(run_id="run_s", config=config))
            elif scenario == "invalid":
                write_orch(out, "run_bad", "batch_size = -1\n")
            else:
                for run_id in ("run_a", "run_b", "run_c"):
                    write_orch(out, run_id)
            first = RegistryProcess(server.url, out, log, crash)
            processes.append(first)
            if scenario == "evict":
                await eventually(lambda: _counts(bus, sj.DISCOVERED, RunDiscovered), 20)
                await bus.publish(sj.EVICT, EvictRequested(run_id="run_a", reason="diverged"))
            assert first.wait() == 137, log.read_text()[-3000:]
            await _assert_crashed_where_asked(bus, out, crash)

            second = RegistryProcess(server.url, out, log)
            processes.append(second)
            if scenario == "submit":
                want = {"run_s": 1}
            elif scenario == "invalid":
                want = {}
            elif scenario == "evict":
                want = {"run_a": 1, "run_b": 1, "run_c": 1}
            else:
                want = {"run_a": 1, "run_b": 1}

            async def converged() -> bool:
                discovered = await _counts(bus, sj.DISCOVERED, RunDiscovered)
                invalid = await _counts(bus, sj.INVALID, RunConfigInvalid)
                evicted = await _counts(bus, sj.EVICTED, RunEvicted)
                records = await table(bus)
                return (
                    dict(discovered) == want
                    and (scenario != "invalid" or dict(invalid) == {"run_bad": 1})
                    and (scenario != "evict" or dict(evicted) == {"run_a": 1})
                    and not any(r.owes_event for r in records.values())
                )

            await eventually(converged, 20)
            assert second.terminate() == 0, log.read_text()[-3000:]
            await _assert_converged(bus, out)
            records = await table(bus)
            if scenario == "evict":  # run_c waited, then took the index run_a gave back
                assert (records["run_a"].status, records["run_a"].idx) == ("evicted", None)
                assert (records["run_c"].idx, records["run_b"].idx) == (0, 1)
                [evicted] = await events_on(bus, sj.EVICTED, RunEvicted)
                assert (evicted.idx, evicted.reason) == (0, "diverged")
            if scenario == "invalid":
                error = (out / "run_bad" / "control" / "config_validation_error.txt").read_text()
                assert error.startswith("batch_size: Input should be greater than or equal to 1")
        finally:
            await bus.close()


async def test_sighup_asks_for_a_scan_now(tmp_path: Path, processes: list[RegistryProcess]) -> None:
    out, log = tmp_path / "out", tmp_path / "registry.log"
    with EmbeddedNats(store_dir=tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, "test")
        try:
            proc = RegistryProcess(server.url, out, log, scan_interval=3600)
            processes.append(proc)
            # serving once its consumers exist (they are created after the first scan)
            await eventually(lambda: _has_consumer(bus, "registry-evict"), 20)
            write_orch(out, "run_late")
            proc.proc.send_signal(signal.SIGHUP)
            await eventually(lambda: _counts(bus, sj.DISCOVERED, RunDiscovered), 10)
            assert proc.terminate() == 0, log.read_text()[-3000:]
        finally:
            await bus.close()


async def _has_consumer(bus: Bus, name: str) -> bool:
    try:
        await bus.js.consumer_info(sj.RUNS_STREAM, name)
    except Exception:
        return False
    return True
