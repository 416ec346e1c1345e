"""Child processes for ``plexrl up``: start, watch, restart after a crash, stop.

Each service runs as its own ``python -m services <command>`` process, as it would in a real
deployment: its own torch thread budget, its own crash. Output goes to
``{output_dir}/logs/<name>.log`` (appended to across restarts, each start marked).

A child that crashes (a non-zero exit status, or a signal) is started again with the same
arguments after an exponential backoff (:class:`RestartPolicy`): every service recovers its
state on start (the trainer from its checkpoints, taking over the batches the dead one held; the
registry from its KV table), so the runs go on. A service that crashes more than
``max_restarts`` times within ``window_s`` seconds, exits with status 2 (settings it cannot use:
a restart cannot help) or exits 0 on its own (it was stopped from outside) makes
:meth:`Supervisor.check` raise :class:`ChildFailed`, and ``plexrl up`` stops everything. A
clean exit during :meth:`Supervisor.stop_all` is not a crash.

:meth:`Supervisor.check` never blocks: it notices exits, schedules restarts and starts those
that are due, so the caller's event loop keeps running during a backoff.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

EXIT_USAGE = 2
"""Unusable settings (services/launch/process.py): the same arguments fail the same way."""


class ChildFailed(RuntimeError):
    """A service process exited while the system was supposed to be running, and stays down."""


@dataclass(frozen=True)
class RestartPolicy:
    """At most ``max_restarts`` restarts of one service within ``window_s`` seconds, the n-th of
    them ``first_delay_s * 2**(n-1)`` seconds after the crash (at most ``max_delay_s``); crashes
    older than the window are forgotten, so a service that ran well for a while starts over at
    the first delay. ``max_restarts = 0``: never restart."""

    max_restarts: int = 5
    window_s: float = 600.0
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0

    def delay(self, recent_crashes: int) -> float:
        """Backoff before the restart that follows ``recent_crashes`` crashes in the window."""
        return min(self.first_delay_s * 2 ** max(0, recent_crashes - 1), self.max_delay_s)


def describe_exit(returncode: int) -> str:
    """``killed by SIGKILL`` for a signal, ``exited with code 1`` otherwise."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    program: list[str] = field(default_factory=lambda: [sys.executable, "-m", "services"])
    """what runs ``argv``: the plexrl command line of this interpreter"""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    """how many times this service was started again after a crash"""
    crashes: deque[float] = field(default_factory=deque)
    """monotonic times of the crashes within the policy's window"""
    last_exit: str = ""
    restart_at: float | None = None
    """when a restart is due (monotonic); None while the process runs"""

    def start(self, note: str = "") -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            if note:
                log.write(f"\n=== plexrl up: {note} ({time.strftime('%H:%M:%S')}) ===\n".encode())
                log.flush()
            self.proc = subprocess.Popen(
                [*self.program, *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches plexrl up, which stops children in order
            )

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> int | None:
        self.restart_at = None
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode


class Supervisor:
    """Starts children in order, restarts those that crash, stops them in reverse order.

    ``notify`` receives one line per crash, restart and surrender (``plexrl up`` prints it
    above its live table, or as a plain line with ``--no-live``).
    """

    def __init__(
        self,
        log_dir: Path,
        policy: RestartPolicy | None = None,
        notify: Callable[[str], None] = lambda line: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_dir = log_dir
        self.policy = policy or RestartPolicy()
        self.notify = notify
        self.clock = clock
        self.children: list[Child] = []
        self._stopping = False

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.log_dir / f"{name}.log", env or {})
        child.start()
        self.children.append(child)
        return child

    def check(self) -> None:
        """Notice exits, schedule and perform restarts; :class:`ChildFailed` when one gives up.
        Does nothing once :meth:`stop_all` has begun."""
        if self._stopping:
            return
        now = self.clock()
        for child in self.children:
            if child.restart_at is not None:
                if now >= child.restart_at:
                    self._restart(child)
                continue
            code = None if child.proc is None else child.proc.poll()
            if code is not None:
                self._crashed(child, code, now)

    def _crashed(self, child: Child, code: int, now: float) -> None:
        policy = self.policy
        child.last_exit = describe_exit(code)
        while child.crashes and now - child.crashes[0] > policy.window_s:
            child.crashes.popleft()
        what = f"{child.name} (pid {child.pid}) {child.last_exit}"
        tail = f"last lines of {child.log_path}:\n{child.log_tail()}"
        if code == 0:
            raise ChildFailed(f"{what} while plexrl up was running (stopped from outside?); {tail}")
        if code == EXIT_USAGE:
            raise ChildFailed(f"{what}: settings it cannot use, a restart cannot help; {tail}")
        if policy.max_restarts == 0:
            raise ChildFailed(f"{what}; not restarting it (max_restarts = 0); {tail}")
        if len(child.crashes) >= policy.max_restarts:
            n = len(child.crashes)
            raise ChildFailed(
                f"{what}; giving up after {n} restart{'s' if n > 1 else ''} within "
                f"{policy.window_s:.0f} s (at most {policy.max_restarts}); {tail}"
            )
        child.crashes.append(now)
        delay = policy.delay(len(child.crashes))
        child.restart_at = now + delay
        self.notify(
            f"{what}; restarting it in {delay:.0f} s (restart {len(child.crashes)} of at most "
            f"{policy.max_restarts} within {policy.window_s:.0f} s; log {child.log_path})"
        )

    def _restart(self, child: Child) -> None:
        child.restart_at = None
        child.restarts += 1
        child.start(note=f"restart {child.restarts} after the process {child.last_exit}")
        self.notify(f"{child.name} restarted (pid {child.pid}, restart {child.restarts})")

    def status(self) -> str | None:
        """One line on the services that crashed so far (None while none has)."""
        now = self.clock()
        parts = []
        for child in self.children:
            if child.restart_at is not None:
                left = max(0.0, child.restart_at - now)
                parts.append(f"{child.name} {child.last_exit}, restarting in {left:.0f} s")
            elif child.restarts:
                times = "once" if child.restarts == 1 else f"{child.restarts} times"
                parts.append(f"{child.name} restarted {times} (last {child.last_exit})")
        return "services: " + "; ".join(parts) if parts else None

    def stop_all(self, timeout: float = 10.0) -> None:
        self._stopping = True
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            child.stop(timeout=max(1.0, deadline - time.monotonic()))
