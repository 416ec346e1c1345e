"""The whole system under SIGKILL: every step of every run trained exactly once, nothing lost.

Each scenario starts the system as separate processes on its own nats-server (tests/faults/
harness.py), trains two short runs, kills one or two processes at steps drawn from a seeded RNG
(its seed is printed; ``--fault-seed N`` replays it), restarts them with the same arguments, and
then checks what the system recorded (tests/faults/invariants.py). How long each fault took
to recover from (tests/faults/harness.py, ``RECOVERIES``) is printed, not asserted: the
liveness timeout is the only bound on time here; tests/faults/test_recovery.py asserts that
nothing waits out a request's timeout.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from services.trainer.checkpoint import read_step_log

from .harness import Fault
from .invariants import replica_loads
from .scenarios import RUNS, make_system, random_faults, run_scenario
from .timing import RECOVERIES

pytestmark = pytest.mark.timeout(600)

STEPS = 12


def _run(rng: random.Random) -> str:
    return rng.choice(RUNS)


async def test_no_fault(tmp_path: Path, tiny_model: Path) -> None:
    """The baseline the fault scenarios are measured against."""
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS), [])


async def test_sigkill_trainer_mid_step(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    # between two checkpoints (interval 4): the restart retrains the steps after the newest
    # checkpoint from the batches the dead trainer held unacknowledged
    at = rng.choice([5, 6, 7, 9, 10])
    fault = Fault("trainer", run=_run(rng), at_step=at, restart_after=rng.uniform(0.2, 2.0))
    system = make_system(tmp_path, tiny_model, steps=STEPS)
    await run_scenario(system, [fault])
    # the first trainer committed each run up to a checkpoint, the second resumed exactly there
    first, second = system.procs["trainer"].pids
    for run_id in RUNS:
        resumed = system.resumed_from[run_id]
        by_pid = {pid: [] for pid in (first, second)}
        for record in read_step_log(system.out, run_id):
            # a kill between a checkpoint and its step log lines leaves them to the restart,
            # which writes them from the checkpoint (no pid): they are the first trainer's steps
            pid = first if record.get("recovered") else record["pid"]
            by_pid[pid].append(record["step"])
        assert by_pid == {first: list(range(resumed)), second: list(range(resumed, STEPS))}
    (took,) = system.recoveries["trainer"]
    print(f"trainer recovery (restart -> next step trained): {took:.1f}s")


async def test_sigkill_trainer_every_replica_loads_the_next_versions(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """Versions after a resume: the restarted trainer resumes from an earlier checkpoint and
    re-trains versions both replicas may already hold (the dead trainer's). Their announcement
    is dropped as a duplicate when the bytes are the same (the digest is in the message id);
    re-trained bytes that differ are announced again, and each replica ignores a version not
    newer than the one it holds. Either way the versions a replica loads never go back
    (checked for every scenario: it fails when both guards are removed) and each replica loads a
    version of each run published after the restart. The lag bound holds throughout (every
    scenario's metrics check)."""
    at = rng.choice([5, 6, 7])  # leaves steps to train, and versions to load, after the restart
    fault = Fault("trainer", run=_run(rng), at_step=at, restart_after=rng.uniform(0.2, 2.0))
    system = make_system(tmp_path, tiny_model, steps=STEPS, replicas=2)
    await run_scenario(system, [fault])
    assert fault.restarted_wall is not None
    for i in range(2):
        loads = replica_loads(system.procs[f"inference-{i}"].log)
        # the run the kill waited for is mid-way at the restart; the other may have finished
        for run_id in [fault.run]:
            after = [v for t, r, v in loads if r == run_id and t >= fault.restarted_wall]
            before = [v for t, r, v in loads if r == run_id and t < fault.restarted_wall]
            assert after, f"inference-{i} loaded no version of {run_id} after the restart: {loads}"
            assert min(after) > max(before, default=-1), (i, run_id, before, after)
            assert min(after) > system.resumed_from[run_id], (i, run_id, after)


async def test_trainer_crash_between_checkpoint_and_step_log(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """Mid-checkpoint: the trainer dies right after a checkpoint is renamed into place, before
    the step log, WeightsReady, progress and acks follow (PLEXRL_FAULT ``trainer.checkpoint``)."""
    run, ckpt = _run(rng), rng.choice([4, 8])
    spec = f"trainer.checkpoint@{run}:{ckpt - 1}"
    fault = Fault("trainer", crash=spec, restart_after=rng.uniform(0.2, 2.0))
    system = make_system(tmp_path, tiny_model, steps=STEPS, trainer_env={"PLEXRL_FAULT": spec})
    await run_scenario(system, [fault])
    # the restart found the checkpoint ahead of the log and logged its steps, none twice
    recovered = [r["step"] for r in read_step_log(system.out, run) if r.get("recovered")]
    assert recovered == list(range(ckpt - 4, ckpt))
    (took,) = system.recoveries["trainer"]
    print(f"trainer recovery (restart -> next step trained): {took:.1f}s")


async def test_sigkill_one_of_two_inference_replicas_mid_generation(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    fault = Fault(
        f"inference-{rng.randrange(2)}",
        run=_run(rng),
        at_step=rng.randint(2, STEPS - 4),
        trigger="generated",
        restart_after=rng.uniform(1.0, 4.0),
    )
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS, replicas=2), [fault])


async def test_sigkill_orchestrator(tmp_path: Path, tiny_model: Path, rng: random.Random) -> None:
    run = _run(rng)
    fault = Fault(
        f"orchestrator-{run}",
        run=run,
        at_step=rng.randint(2, STEPS - 3),
        trigger="generated",
        restart_after=rng.uniform(0.2, 2.0),
    )
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS), [fault])


async def test_sigkill_registry(tmp_path: Path, tiny_model: Path, rng: random.Random) -> None:
    fault = Fault(
        "registry",
        run=_run(rng),
        at_step=rng.randint(2, STEPS - 3),
        restart_after=rng.uniform(0.2, 3.0),
    )
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS), [fault])


async def test_sigkill_nats_server_and_restart_on_the_same_store(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    fault = Fault(
        "nats",
        run=_run(rng),
        at_step=rng.randint(2, STEPS - 3),
        restart_after=rng.uniform(1.0, 4.0),
    )
    system = make_system(tmp_path, tiny_model, steps=STEPS)
    await run_scenario(system, [fault])
    print(f"recovery after the nats-server restart: {system.recoveries['nats']}")


@pytest.mark.slow
async def test_two_faults_at_once_trainer_and_nats(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """The issue's case: the trainer dies, the nats-server dies while it is down, and the
    trainer comes back while the server is still down (it must wait for it)."""
    trainer = Fault("trainer", run=_run(rng), at_step=rng.randint(5, 8), restart_after=1.0)
    nats = Fault("nats", after=0.3, restart_after=rng.uniform(3.0, 6.0))
    system = make_system(tmp_path, tiny_model, steps=STEPS)
    await run_scenario(system, [trainer, nats])
    print(f"recovery with the nats-server down meanwhile: {system.recoveries}")


@pytest.mark.slow
async def test_two_faults_at_once_orchestrator_and_inference(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    run = _run(rng)
    at = rng.randint(3, STEPS - 4)
    faults = [
        Fault(f"orchestrator-{run}", run=run, at_step=at, trigger="generated", restart_after=1.5),
        Fault(f"inference-{rng.randrange(2)}", after=0.0, restart_after=rng.uniform(0.5, 2.0)),
    ]
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS, replicas=2), faults)


@pytest.mark.slow
async def test_two_faults_at_once_registry_and_orchestrator(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """The orchestrator comes back while the registry is still down: it finds its run in the
    run table and resumes without the registry's admission."""
    run = _run(rng)
    faults = [
        Fault(
            "registry",
            run=run,
            at_step=rng.randint(3, STEPS - 5),
            trigger="generated",
            restart_after=rng.uniform(4.0, 8.0),
        ),
        Fault(f"orchestrator-{run}", after=0.0, restart_after=0.5),
    ]
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS), faults)


async def test_soak(
    tmp_path: Path, tiny_model: Path, rng: random.Random, soak_seconds: float
) -> None:
    """``--soak SECONDS``: randomized scenarios, one after another, for that long."""
    if soak_seconds <= 0:
        pytest.skip("pass --soak SECONDS to run randomized scenarios for that long")
    deadline = time.monotonic() + soak_seconds
    rounds, recoveries = 0, {kind: [] for kind in RECOVERIES}
    while time.monotonic() < deadline:
        replicas = rng.choice([1, 2])
        faults, trainer_env = random_faults(rng, 16, replicas)
        root = tmp_path / f"round-{rounds}"
        system = make_system(
            root, tiny_model, steps=16, replicas=replicas, seed=rounds, trainer_env=trainer_env
        )
        print(f"soak round {rounds}: {[f.describe() for f in faults]}", flush=True)
        await run_scenario(system, faults, allow_skips=True)
        for target, took in system.recoveries.items():
            recoveries[target] += took
        rounds += 1
    print(f"soak: {rounds} scenarios passed")
    for kind, took in recoveries.items():
        print(f"recovery ({RECOVERIES[kind]}): {_seconds(took)}")


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.1f}s" for v in values) or "none"
