"""How long the system takes to recover from each fault, as :class:`~.harness.System` times it
(printed by every scenario; :mod:`.test_recovery` asserts what matters of it)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .harness import Fault, System

LIVENESS_S = 240.0
"""A run that makes no progress for this long, or a recovery that takes this long, fails the
scenario (a hang, not slowness)."""

RECOVERIES = {
    "trainer": "restart -> a step trained past its newest checkpoint",
    "nats": "restart -> every unfinished run trained a step generated after it",
    "registry": "restart -> serving again",
    "inference": "restart -> serving again",
    "orchestrator": "restart -> its run's next step generated",
    "request": "SIGKILL of the replica holding a request -> the step it was generating",
}
"""What a recovery's seconds measure, by kind of fault (:attr:`System.recoveries`)."""


async def time_restart(
    system: System, target: str, restarted: float, trained: dict[str, int]
) -> None:
    """Seconds from a restart of ``target`` until training goes on: for the trainer, until
    it has trained a step of any run past ``trained`` (its checkpoints); for the nats-server,
    until every run not yet finished has trained a step generated after the restart (with
    ``max_async_level`` 1, two steps past ``trained``, where it was)."""
    deadline = time.monotonic() + LIVENESS_S
    waiting = {r for r in system.runs if trained[r] < system.runs[r].max_steps}
    if target == "nats":
        trained = {r: min(s + 2, system.runs[r].max_steps - 1) for r, s in trained.items()}
    if not waiting:
        system.log(f"{target} restarted after the last step: no recovery to time")
        return
    took = 0.0
    while waiting and time.monotonic() < deadline:
        for run_id in sorted(waiting):
            p = await system.progress(run_id)
            if p is not None and p.updated_at > restarted and p.step > trained[run_id]:
                took = p.updated_at - restarted
                system.log(f"after the {target} restart {run_id} trained step {p.step - 1}")
                waiting = set() if target == "trainer" else waiting - {run_id}
        await asyncio.sleep(0.1)
    if waiting:
        raise AssertionError(f"no training within {LIVENESS_S:.0f}s of the {target} restart")
    system.recoveries[target].append(took)
    system.log(f"recovery after the {target} restart: {took:.1f}s")


async def time_service(system: System, target: str) -> None:
    """Seconds from a restart of a registry or an inference replica until it serves again,
    of an orchestrator until its run has generated one more step (not timed when its run
    had been generated already)."""
    started, proc = time.monotonic(), system.procs[target]
    kind, _, run_id = target.partition("-")
    if kind == "orchestrator":
        before = system.generated(run_id)
        if before >= system.runs[run_id].max_steps:
            return
        done = lambda: system.generated(run_id) > before  # noqa: E731
    else:
        done = proc.ready
    while not done():
        if time.monotonic() - started > LIVENESS_S:
            raise AssertionError(f"{target}: not back within {LIVENESS_S:.0f}s of its restart")
        await asyncio.sleep(0.1)
    took = time.monotonic() - started
    system.recoveries[kind].append(took)
    system.log(f"recovery after the {target} restart: {took:.1f}s")


async def time_request(system: System, fault: Fault) -> None:
    """Seconds from the kill of a replica holding a request of ``fault.run`` until the step
    it was generating (``fault.killed_at_step`` were done) is generated; nothing to time when
    the replica had answered first."""
    run_id, generated, killed = fault.run, fault.killed_at_step, fault.killed_at
    assert generated is not None and killed is not None
    deadline = killed + LIVENESS_S
    while system.generated(run_id) <= generated:
        if fault.answered_first:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{run_id}: step {generated} not generated after the kill")
        await asyncio.sleep(0.05)
    if fault.answered_first:
        return
    took = time.monotonic() - killed
    system.recoveries["request"].append(took)
    system.log(f"recovery after the replica's kill: {run_id} step {generated} in {took:.1f}s")
