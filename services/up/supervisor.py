"""Child processes for ``plexrl up``: start, watch, stop.

Each service runs as its own ``python -m services <command>`` process, as it would in a real
deployment: its own torch thread budget, its own crash. Output goes to
``{output_dir}/logs/<name>.log``; a child that dies is reported with the tail of its log.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


class ChildFailed(RuntimeError):
    """A service process exited while the system was supposed to be running."""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services", *self.argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # Ctrl-C reaches plexrl up, which stops children in order
            )

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise ChildFailed(
                f"{self.name} exited with code {self.proc.returncode}; last lines of {self.log_path}:\n"
                f"{self.log_tail()}"
            )

    def stop(self, timeout: float = 10.0) -> int | None:
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
    """Starts children in order and stops them in reverse order."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.children: list[Child] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        child = Child(name, argv, self.log_dir / f"{name}.log", env or {})
        child.start()
        self.children.append(child)
        return child

    def check(self) -> None:
        for child in self.children:
            child.check()

    def stop_all(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        for child in reversed(self.children):
            child.stop(timeout=max(1.0, deadline - time.monotonic()))
