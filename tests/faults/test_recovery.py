"""Recovery in seconds: nothing waits out a timeout after a fault, whatever was in flight.

Each scenario kills its target the moment an inference replica takes a generate request of a
run (the ``holding`` trigger, tests/faults/harness.py), so a request is in flight, and every
orchestrator has its default generate timeout of 120 s. A request lost with the broker is sent
again when the orchestrator reconnects, and the replica answers it once (the same generation, or
its stored answer); one held by a killed replica is sent again when the replica's progress
messages stop. Each test asserts that this happened (the orchestrator's log says so), that the
runs went on well before the lost request's timeout could have fired (half of it, a bound no
scheduling delay reaches), and everything every scenario checks (every step trained exactly
once); the measured recovery is printed.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from .harness import Fault, System, run_config
from .scenarios import RUNS, run_scenario

pytestmark = pytest.mark.timeout(600)

STEPS = 8
REQUEST_TIMEOUT = 120.0
"""the orchestrators' generate timeout (their default): what a lost request used to wait out"""
RESENT = "the connection was made again while waiting for the reply; sending it again"
"""what an orchestrator logs when it sends a request again on a reconnect"""
SILENT = "went silent for"
"""what it logs when it sends a request again because the replica holding it went silent"""


def _system(root: Path, model: Path, replicas: int = 1) -> System:
    runs = {run_id: run_config(STEPS, i) for i, run_id in enumerate(RUNS)}
    return System(root, model, runs, replicas=replicas)


def _said(system: System, run_id: str, text: str) -> bool:
    return text in system.procs[f"orchestrator-{run_id}"].log.read_text(errors="replace")


async def test_trainer_and_broker_killed_together_resume_seconds_after_the_broker(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """The issue's case: the broker and the trainer die together while a generate request is in
    flight; a new trainer is started while the broker is down (it waits for it); the broker
    comes back 5 s later on its store. Training resumed 114 s after the broker's return, when
    the lost request timed out; now the request goes again on the reconnect."""
    run = rng.choice(RUNS)
    faults = [
        Fault("nats", run=run, at_step=rng.randint(2, 4), trigger="holding", restart_after=6.0),
        Fault("trainer", after=0.0, restart_after=1.0),
    ]
    system = _system(tmp_path, tiny_model)
    await run_scenario(system, faults)
    (took,) = system.recoveries["nats"]
    print(f"steps resumed {took:.1f}s after the broker's return (trainer restarted meanwhile)")
    assert took < REQUEST_TIMEOUT / 2, system.events
    assert _said(system, run, RESENT)


async def test_broker_killed_mid_generation_resumes_seconds_after_its_return(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """The broker dies while a replica holds a request and comes back 3 s later: the request
    (or its reply) died with it, and the orchestrator sends it again on the reconnect. A tiny
    model's reply can get out before the SIGKILL that the replica's progress message set off
    (this process, on busy cores, reads the message late); then nothing was lost, nothing is
    sent again, and the scenario is made again. Every attempt must recover in seconds."""
    for attempt in range(3):
        run = rng.choice(RUNS)
        fault = Fault(
            "nats", run=run, at_step=rng.randint(2, 5), trigger="holding", restart_after=3.0
        )
        system = _system(tmp_path / f"try{attempt}", tiny_model)
        await run_scenario(system, [fault])
        (took,) = system.recoveries["nats"]
        print(f"steps resumed {took:.1f}s after the broker's return")
        assert took < REQUEST_TIMEOUT / 2, system.events
        if _said(system, run, RESENT):
            break
    assert _said(system, run, RESENT), "every kill came after the request's reply"


async def test_replica_killed_mid_request_the_other_answers_within_seconds(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """One of two replicas dies holding a request: its progress messages stop, and the
    orchestrator sends the request again (the other replica answers) after 3 silent beats.
    A tiny model's answer can come before the SIGKILL that its progress message set off (this
    process, on busy cores, reads the message late); then nothing was lost, and the scenario
    is made again."""
    for attempt in range(3):
        run, replica = rng.choice(RUNS), rng.randrange(2)
        fault = Fault(
            f"inference-{replica}",
            run=run,
            at_step=rng.randint(2, 5),
            trigger="holding",
            restart_after=rng.uniform(3.0, 6.0),
        )
        system = _system(tmp_path / f"try{attempt}", tiny_model, replicas=2)
        await run_scenario(system, [fault])
        if not fault.answered_first:
            break
    assert not fault.answered_first, "every kill came after the replica's answer"
    (took,) = system.recoveries["request"]
    print(f"the step the killed replica held was generated {took:.1f}s after the kill")
    assert took < REQUEST_TIMEOUT / 2, system.events
    assert _said(system, run, SILENT)
