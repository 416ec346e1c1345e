"""Service processes of the fault suite: started with the same arguments every time, killed with
SIGKILL, stopped with SIGTERM, each with its log; none outlives the test process."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
READY = {
    "registry": "registry: serving",
    "trainer": "trainer: rank 0/",
    "inference": "serving plexrl.inference.generate",
}
"""What each service logs once it serves (and handles SIGTERM by stopping cleanly)."""


@dataclass
class Proc:
    """One service process: started, killed and started again with the same arguments."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str]
    popen: subprocess.Popen[bytes] | None = None
    pids: list[int] = field(default_factory=list)

    def start(self) -> None:
        with open(self.log, "ab") as out:
            out.write(f"\n=== start {time.strftime('%H:%M:%S')} ===\n".encode())
            out.flush()
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "services", *self.argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=REPO,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.pids.append(self.popen.pid)

    def kill(self, signalled: bool = False) -> None:
        """SIGKILL it (``signalled``: it was sent already) and wait for it to end."""
        assert self.popen is not None, f"{self.name} was never started"
        if not signalled:
            assert self.popen.poll() is None, f"{self.name} is not running"
            self.popen.send_signal(signal.SIGKILL)
        assert self.popen.wait(30) == -signal.SIGKILL

    def exited(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, as an operator stops a service; SIGKILL if it does not exit in time."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
                return None
        return self.popen.returncode

    def ready(self) -> bool:
        """The latest start has logged that it serves (always true of an orchestrator)."""
        marker = READY.get(self.argv[0])
        if marker is None:
            return True
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return marker in text.rpartition("=== start ")[2]

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.log} ---\n" + "\n".join(text.splitlines()[-lines:])


def clean_env() -> dict[str, str]:
    """This environment without PLEXRL_ and OTEL_ variables, offline, one torch thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "OTEL_"))}
    return env | {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PLEXRL_CONNECT_WAIT_S": "120",
    }


def _die_with_parent() -> None:
    """In the child: SIGKILL it if the test process dies (a timeout, Ctrl-C), so that no
    service outlives the suite."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
