"""The system on a three-server JetStream cluster: streams, buckets and the object store have
three replicas (``PLEXRL_STREAM_REPLICAS=3``) and every service is given all three servers.

One server SIGKILLed mid-run: the other two keep a quorum, every stream elects a new leader
where it must, clients move to a live server, and the runs finish with the usual invariants.

Two servers SIGKILLed at once and kept down longer than one round of a publish's retries: no
stream has a quorum, so JetStream stops answering. The services say so in their logs and wait
instead of exiting; once the servers are back (on their own stores) training resumes, and the
runs finish with the same invariants: nothing acknowledged is lost, no step trained twice.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from pathlib import Path

import pytest

from services.bus import EmbeddedNats

from .harness import Fault, System, run_config
from .scenarios import RUNS, run_scenario

pytestmark = pytest.mark.timeout(300)

STEPS = 8
SERVERS = 3
NO_QUORUM_S = (15.0, 18.0)
"""How long the two killed servers stay down: longer than a publish's retries (about 16 s)."""
ACK_WAIT_S = 30
"""The trainer's ack_wait in the no-quorum scenario (see :class:`_NoQuorum`)."""


def _system(root: Path, model: Path) -> System:
    runs = {run_id: run_config(STEPS, i) for i, run_id in enumerate(RUNS)}
    return System(root, model, runs, cluster=SERVERS)


async def test_sigkill_one_of_three_servers(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    node = f"nats-{rng.randrange(SERVERS)}"
    fault = Fault(node, run=rng.choice(RUNS), at_step=rng.randint(2, 4), restart_after=2.0)
    system = _system(tmp_path, tiny_model)
    await run_scenario(system, [fault])


class _NoQuorum(System):
    """Kills two of the three servers at once: the two that serve the most of the services, so
    that at least one service loses its connection as well as the quorum."""

    def __init__(self, root: Path, model: Path, faults: list[Fault]) -> None:
        runs = {run_id: run_config(STEPS, i) for i, run_id in enumerate(RUNS)}
        # A batch the consumer hands to the trainer through a server at the moment that server
        # is SIGKILLed is lost in flight; the server delivers it again only when the trainer's
        # ack_wait runs out (300 s by default, past the liveness bound): 30 s here.
        env = {"PLEXRL_ACK_WAIT": str(ACK_WAIT_S)}
        super().__init__(root, model, runs, cluster=SERVERS, trainer_env=env)
        self.faults = faults
        self.cut_off: Counter[str] = Counter()
        """the services' connections to the killed servers when they were killed (less the
        orchestrators that had finished their runs by then)"""
        self._wanted = Counter({"registry": 1, "trainer": 1, "inference": 1, "orchestrator": 2})

    async def start(self) -> None:
        await super().start()
        assert self.cluster is not None
        wanted = self._wanted
        deadline = time.monotonic() + 120
        while True:
            served = [Counter(self._names(node)) for node in self.cluster.nodes]
            if sum(served, Counter()) >= wanted or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert sum(served, Counter()) >= wanted, f"clients per server: {served}"
        load = [sum((on & wanted).values()) for on in served]
        survivor = load.index(min(load))
        down = [i for i in range(SERVERS) if i != survivor]
        for fault, node in zip(self.faults, down, strict=True):
            fault.target = f"nats-{node}"
        self.log(f"clients per server {served}: killing {[f.target for f in self.faults]}")

    async def _kill(self, fault: Fault) -> None:
        if fault is self.faults[0]:
            assert self.cluster is not None
            down = [self.cluster.nodes[int(f.target.removeprefix("nats-"))] for f in self.faults]
            self.cut_off = sum((Counter(self._names(n)) & self._wanted for n in down), Counter())
        await super()._kill(fault)
        if fault is self.faults[0]:
            done = [n for n, p in self.procs.items() if n.startswith("orch") and p.exited() == 0]
            self.cut_off["orchestrator"] -= len(done)

    def _names(self, node: EmbeddedNats) -> list[str]:
        assert self.cluster is not None
        return [n.removeprefix("plexrl-") for n in self.cluster.clients(node)]


async def test_sigkill_two_of_three_servers_no_quorum(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """Two servers down at once for longer than a publish retries: no stream has a quorum. The
    services cut off say so and reconnect, none exits, and the runs finish with nothing
    acknowledged lost."""
    down = rng.uniform(*NO_QUORUM_S)
    faults = [
        Fault("nats-?", run=rng.choice(RUNS), at_step=rng.randint(2, 4), restart_after=down),
        Fault("nats-?", after=0.0, restart_after=down + rng.uniform(0.0, 2.0)),
    ]
    system = _NoQuorum(tmp_path, tiny_model, faults)
    await run_scenario(system, faults)
    logs = {name: p.log.read_text(errors="replace") for name, p in system.procs.items()}
    for service, connections in system.cut_off.items():
        said = [
            log
            for name, log in logs.items()
            if name.partition("-")[0] == service and "disconnected from NATS, reconnecting" in log
        ]
        assert len(said) >= connections, f"{service}: {len(said)} of {connections} said so"
        assert all("reconnected to NATS" in log for log in said), service
    # the loss of quorum is reported: one line when an operation starts waiting, one when it
    # resumes (none gave up: every service ran to the end)
    waits = {name: _outage_lines(log, WAITING) for name, log in logs.items()}
    resumed = {name: _outage_lines(log, RESUMED) for name, log in logs.items()}
    assert any(NO_QUORUM in line for lines in waits.values() for line in lines), waits
    for name in logs:
        assert _operations(waits[name]) == _operations(resumed[name]), (name, waits, resumed)


WAITING, RESUMED = "; waiting for as long as it lasts", ": JetStream answers again: resumed"
NO_QUORUM = "JetStream has no quorum: only 1 of 3 NATS servers reachable"


def _outage_lines(log: str, marker: str) -> list[str]:
    """What services/bus/retry.py logged with ``marker`` (a wait, or a resumption)."""
    return [line for line in log.splitlines() if "services.bus.retry: " in line and marker in line]


def _operations(lines: list[str]) -> Counter[str]:
    """The operations ``lines`` name ("trainer: acknowledging ..."), counted."""
    return Counter(
        line.partition("services.bus.retry: ")[2].partition(": JetStream ")[0] for line in lines
    )
