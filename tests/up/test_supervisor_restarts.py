"""``plexrl up``'s supervisor: a crashed child is started again after a growing delay, a bounded
number of times within a window; exits a restart cannot fix stop everything at once.

Real child processes (a Python one-liner instead of a service, so each test takes a second or
two) and a hand-driven clock, so that no test sleeps through a backoff.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
from rich.console import Console

from services.up.supervisor import (
    Child,
    ChildFailed,
    RestartPolicy,
    Supervisor,
    describe_exit,
)
from services.up.view import live_table


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _supervisor(tmp_path: Path, policy: RestartPolicy) -> tuple[Supervisor, Clock, list[str]]:
    clock, lines = Clock(), []
    return Supervisor(tmp_path / "logs", policy, notify=lines.append, clock=clock), clock, lines


def _start(sup: Supervisor, name: str, code: str) -> Child:
    """A child running ``python -c code`` (in place of ``python -m services ...``)."""
    child = Child(name, ["-c", code], sup.log_dir / f"{name}.log", program=[sys.executable])
    child.start()
    sup.children.append(child)
    return child


def _wait_exit(child: Child) -> int:
    assert child.proc is not None
    return child.proc.wait(timeout=30)


def test_exit_descriptions() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert describe_exit(1) == "exited with code 1"
    assert describe_exit(137) == "exited with code 137"


def test_backoff_doubles_up_to_the_cap() -> None:
    policy = RestartPolicy(first_delay_s=1.0, max_delay_s=5.0)
    assert [policy.delay(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_crashed_child_restarts_with_backoff_then_up_gives_up(tmp_path: Path) -> None:
    policy = RestartPolicy(max_restarts=2, window_s=60.0, first_delay_s=1.0)
    sup, clock, lines = _supervisor(tmp_path, policy)
    child = _start(sup, "trainer", "import sys; print('boom'); sys.exit(1)")
    first_pid = child.pid
    _wait_exit(child)

    sup.check()
    assert lines == [
        f"trainer (pid {first_pid}) exited with code 1; restarting it in 1 s (restart 1 of at "
        f"most 2 within 60 s; log {child.log_path})"
    ]
    assert sup.status() == "services: trainer exited with code 1, restarting in 1 s"
    clock.now += 0.5
    sup.check()  # not due yet: nothing is started
    assert child.pid == first_pid and len(lines) == 1

    clock.now += 0.5
    sup.check()
    assert child.pid != first_pid
    assert lines[-1] == f"trainer restarted (pid {child.pid}, restart 1)"
    second_pid = child.pid
    _wait_exit(child)

    sup.check()  # the second crash waits twice as long
    assert lines[-1].startswith(
        f"trainer (pid {second_pid}) exited with code 1; restarting it in 2 s"
    )
    clock.now += 1.9
    sup.check()
    assert child.pid == second_pid
    clock.now += 0.1
    sup.check()
    assert child.restarts == 2
    assert sup.status() == "services: trainer restarted 2 times (last exited with code 1)"
    _wait_exit(child)

    with pytest.raises(ChildFailed) as failed:
        sup.check()
    message = str(failed.value)
    assert "giving up after 2 restarts within 60 s (at most 2)" in message
    assert "boom" in message  # the tail of its log says why
    log = child.log_path.read_text()
    assert log.count("boom") == 3
    assert "=== plexrl up: restart 1 after the process exited with code 1" in log
    assert "=== plexrl up: restart 2 after the process exited with code 1" in log


def test_crashes_older_than_the_window_are_forgotten(tmp_path: Path) -> None:
    policy = RestartPolicy(max_restarts=1, window_s=30.0, first_delay_s=1.0)
    sup, clock, lines = _supervisor(tmp_path, policy)
    child = _start(sup, "registry", "import os; os.kill(os.getpid(), 9)")
    for restart in (1, 2):
        _wait_exit(child)
        sup.check()
        assert "killed by SIGKILL; restarting it in 1 s (restart 1 of at most 1" in lines[-1]
        clock.now += 1.0
        sup.check()
        assert child.restarts == restart
        clock.now += 31.0  # a calm half-minute: the crash falls out of the window
    # two crashes within the window: the second is one too many
    _wait_exit(child)
    sup.check()
    clock.now += 1.0
    sup.check()
    assert child.restarts == 3
    _wait_exit(child)
    with pytest.raises(ChildFailed, match="giving up after 1 restart within 30 s"):
        sup.check()


def test_a_child_killed_by_a_signal_is_a_crash(tmp_path: Path) -> None:
    sup, clock, lines = _supervisor(tmp_path, RestartPolicy())
    child = _start(sup, "inference", "import time; time.sleep(60)")
    sup.check()
    assert lines == []
    assert child.proc is not None
    child.proc.send_signal(signal.SIGKILL)
    _wait_exit(child)
    sup.check()
    assert lines[0].startswith(
        f"inference (pid {child.pid}) killed by SIGKILL; restarting it in 1 s"
    )
    clock.now += 1.0
    sup.check()
    assert child.proc.poll() is None  # the restarted process runs
    sup.stop_all(timeout=10)
    assert child.proc.returncode == -signal.SIGTERM
    sup.check()  # a stop is not a crash: nothing is scheduled, nothing raised
    assert len(lines) == 2 and child.restart_at is None


def test_unusable_settings_and_an_exit_0_are_not_restarted(tmp_path: Path) -> None:
    sup, _, lines = _supervisor(tmp_path, RestartPolicy())
    child = _start(sup, "trainer", "import sys; sys.exit(2)")
    _wait_exit(child)
    with pytest.raises(ChildFailed, match="exited with code 2: settings it cannot use"):
        sup.check()
    sup.children.clear()
    child = _start(sup, "registry", "pass")
    _wait_exit(child)
    with pytest.raises(ChildFailed, match="exited with code 0 while plexrl up was running"):
        sup.check()
    assert lines == []


def test_max_restarts_0_never_restarts(tmp_path: Path) -> None:
    sup, _, lines = _supervisor(tmp_path, RestartPolicy(max_restarts=0))
    child = _start(sup, "trainer", "import sys; sys.exit(1)")
    _wait_exit(child)
    with pytest.raises(ChildFailed, match=r"not restarting it \(max_restarts = 0\)"):
        sup.check()
    assert lines == []


def test_stop_all_cancels_a_pending_restart(tmp_path: Path) -> None:
    sup, clock, lines = _supervisor(tmp_path, RestartPolicy())
    child = _start(sup, "trainer", "import sys; sys.exit(1)")
    _wait_exit(child)
    sup.check()
    assert child.restart_at is not None
    sup.stop_all(timeout=5)
    assert child.restart_at is None
    first_pid = child.pid
    clock.now += 100.0
    sup.check()
    assert child.restarts == 0 and child.pid == first_pid
    assert len(lines) == 1


def test_the_live_table_shows_the_services_line() -> None:
    console = Console(width=200, record=True)
    console.print(live_table([], 3.0, "plexrl up", caption="services: trainer restarted once"))
    text = console.export_text()
    assert "services: trainer restarted once" in text
    console = Console(width=200, record=True)
    console.print(live_table([], 3.0, "plexrl up"))
    assert "services:" not in console.export_text()
