"""Hung services under ``plexrl up``: pinged like a container's liveness probe, killed when
they stop answering, then restarted by the :class:`~.supervisor.Supervisor` like any crash.

The supervisor notices processes that exit. A process that is still there but stuck (a deadlock,
a frozen event loop, a ``SIGSTOP``, a connection to NATS that is gone while the process runs on)
never exits, so the runs would wait on it forever. Every ``interval_s`` seconds the watchdog
sends one ``$SRV.PING`` per service (:mod:`services.launch.health`, the same check as
``plexrl health`` and the Kubernetes probes) and matches the answers to the supervisor's children
by pid. A child that has answered once and then misses ``misses`` rounds in a row is killed
with SIGKILL; the supervisor sees it die and restarts it with its backoff, and the line it
prints says why. A child that never answered (still loading its model, or a build that does not
register) is left alone, as is every child while plexrl up's own connection to NATS is down: a
ping nobody could answer proves nothing.

The defaults (30 s apart, 3 misses, 10 s for the answers) are the Kubernetes liveness probe's of
``deploy/k8s/``: a service gets about 90 s to answer again before it is restarted.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.bus import Bus
from services.launch.health import ping, this_host
from services.up.supervisor import Child, Supervisor

log = logging.getLogger(__name__)


@dataclass
class Watchdog:
    """Pings ``supervisor``'s children over ``bus``; kills those that stop answering."""

    bus: Bus
    supervisor: Supervisor
    interval_s: float = 30.0
    misses: int = 3
    timeout_s: float = 10.0
    notify: Callable[[str], None] = lambda line: None
    answered: set[int] = field(default_factory=set)
    """pids that answered at least once"""
    missed: dict[int, int] = field(default_factory=dict)
    """pid -> rounds missed in a row"""

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.misses < 1 or self.timeout_s <= 0:
            raise ValueError(
                f"need interval_s > 0, misses >= 1 and timeout_s > 0, got {self.interval_s}, "
                f"{self.misses} and {self.timeout_s}"
            )

    async def run(self, stop: asyncio.Event) -> None:
        """Check every ``interval_s`` seconds until ``stop`` is set."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.check_once()
            except Exception:  # a watchdog that dies would watch nothing: log and go on
                log.exception("health check of plexrl up's services failed")
            left = self.interval_s - (time.monotonic() - started)
            if left > 0:
                try:
                    await asyncio.wait_for(stop.wait(), left)
                except TimeoutError:
                    pass

    async def check_once(self) -> None:
        """One round: ping each running child's service, count misses, kill the hung."""
        if not self.bus.nc.is_connected:
            return
        children = [c for c in self.supervisor.children if _running(c)]
        timeout, host = min(self.timeout_s, self.interval_s), this_host()
        answers = await asyncio.gather(
            *(ping(self.bus.nc, c.name, host, timeout, pid=c.pid) for c in children)
        )
        if not self.bus.nc.is_connected:  # lost while waiting: the silence proves nothing
            return
        for child, got in zip(children, answers, strict=True):
            pid = child.pid
            assert pid is not None
            if got and got[-1].pid == str(pid) and got[-1].host == host:  # ping's match is last
                self.answered.add(pid)
                self.missed.pop(pid, None)
                continue
            if pid not in self.answered:
                continue
            self.missed[pid] = missed = self.missed.get(pid, 0) + 1
            if missed >= self.misses:
                self._kill(child, missed)

    def _kill(self, child: Child, missed: int) -> None:
        assert child.proc is not None
        line = (
            f"{child.name} (pid {child.pid}) did not answer {missed} health pings in a row "
            f"({self.interval_s:g} s apart): hung, or cut off from NATS; killing it"
        )
        self.notify(line)
        self.missed.pop(child.proc.pid, None)
        child.proc.send_signal(signal.SIGKILL)


def _running(child: Child) -> bool:
    return child.restart_at is None and child.proc is not None and child.proc.poll() is None
