"""The whole system under SIGKILL: every step of every run trained exactly once, nothing lost.

Each scenario starts the system as separate processes on its own nats-server (tests/faults/
harness.py), trains two short runs, and kills one or two processes, restarting each with the
same arguments, at every one of the scenario's fixed points, one after another in one run of
the system (so a bug at any of those windows fails every CI run), and at one more point drawn
from a seeded RNG (its seed is printed; ``--fault-seed N`` replays it); ``--soak SECONDS`` adds
randomized schedules. Then it checks what the system recorded (tests/faults/invariants.py). How
long each fault took to recover from (tests/faults/harness.py, ``RECOVERIES``) is printed, not
asserted: the liveness timeout is the only bound on time here; tests/faults/test_recovery.py
asserts that nothing waits out a request's timeout.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from services.trainer.checkpoint import read_step_log

from .harness import Fault, System, Trigger
from .invariants import replica_loads
from .scenarios import RUNS, make_system, random_faults, run_scenario
from .timing import RECOVERIES

pytestmark = pytest.mark.timeout(600)

STEPS = 12
CHECKPOINT = 4
"""the checkpoint interval of the scenarios' runs (tests/faults/harness.py, ``run_config``)"""


def _points(rng: random.Random, fixed: tuple[int, ...], lo: int, hi: int) -> list[int]:
    """The steps a scenario's faults come at: every one of ``fixed``, each run of the suite, and
    one more drawn from ``lo..hi`` (none of ``fixed``), in step order."""
    extra = rng.choice([p for p in range(lo, hi + 1) if p not in fixed])
    return sorted([*fixed, extra])


def _kills(
    rng: random.Random,
    target: str,
    run: str,
    points: list[int],
    *,
    trigger: Trigger = "trained",
    restart: tuple[float, float] = (0.2, 2.0),
) -> list[Fault]:
    """SIGKILL ``target`` at each of ``points`` of ``run``, each restart after a seeded delay."""
    return [
        Fault(target, run=run, at_step=at, trigger=trigger, restart_after=rng.uniform(*restart))
        for at in points
    ]


def _recoveries(system: System, target: str) -> str:
    return ", ".join(f"{t:.1f}s" for t in system.recoveries[target])


def _check_resumed_at_checkpoints(system: System) -> None:
    """Every trainer process trained a run from where the one before it left off, and that is
    a checkpoint: the step log holds each step once, the processes' steps in the order they
    started, and each later process's first step of a run is a multiple of the interval (the
    last one's is the checkpoint it found at its start)."""
    pids = system.procs["trainer"].pids
    for run_id in RUNS:
        owners: list[tuple[int, int]] = []  # (index of the trainer process, step)
        for record in read_step_log(system.out, run_id):
            # a kill between a checkpoint and its step log lines leaves them to the restart,
            # which writes them from the checkpoint (no pid): they are an earlier process's
            if record.get("recovered"):
                owners.append((owners[-1][0] if owners else 0, record["step"]))
            else:
                owners.append((pids.index(record["pid"]), record["step"]))
        assert [step for _, step in owners] == list(range(STEPS)), (run_id, owners)
        assert [i for i, _ in owners] == sorted(i for i, _ in owners), (run_id, owners)
        firsts = {i: step for i, step in reversed(owners)}
        assert all(step % CHECKPOINT == 0 for step in firsts.values()), (run_id, owners)
        last = len(pids) - 1
        if last in firsts:
            assert firsts[last] == system.resumed_from[run_id], (run_id, owners)


async def test_no_fault(tmp_path: Path, tiny_model: Path) -> None:
    """The baseline the fault scenarios are measured against."""
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS), [])


async def test_sigkill_trainer_mid_step(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """Before the first checkpoint (the restart starts the run over), just after a checkpoint
    and just before the next: the restart retrains the steps after the newest checkpoint from
    the batches the dead trainer held unacknowledged."""
    faults = _kills(rng, "trainer", "run_a", _points(rng, (2, 5, 7), 1, STEPS - 2))
    system = make_system(tmp_path, tiny_model, steps=STEPS)
    await run_scenario(system, faults)
    _check_resumed_at_checkpoints(system)
    print(f"trainer recoveries (restart -> next step trained): {_recoveries(system, 'trainer')}")


async def test_sigkill_trainer_every_replica_loads_the_next_versions(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """Versions after a resume: the restarted trainer resumes from an earlier checkpoint and
    re-trains versions both replicas may already hold (the dead trainer's). Their announcement
    is dropped as a duplicate when the bytes are the same (the digest is in the message id);
    re-trained bytes that differ are announced again, and each replica ignores a version not
    newer than the one it holds. Either way the versions a replica loads never go back
    (checked for every scenario: it fails when both guards are removed), none older than the
    resumed checkpoint, and each replica loads a version trained after the last restart. The lag bound holds throughout
    (every scenario's metrics check)."""
    # each leaves steps to train, and versions to load, after its restart
    faults = _kills(rng, "trainer", "run_b", _points(rng, (5,), 6, 7))
    system = make_system(tmp_path, tiny_model, steps=STEPS, replicas=2)
    await run_scenario(system, faults)
    last = faults[-1]
    assert last.restarted_wall is not None
    for i in range(2):
        loads = replica_loads(system.procs[f"inference-{i}"].log)
        # the run the kills waited for is mid-way at the restart; the other may have finished
        after = [v for t, r, v in loads if r == last.run and t >= last.restarted_wall]
        before = [v for t, r, v in loads if r == last.run and t < last.restarted_wall]
        assert after, f"inference-{i} loaded no version of {last.run} after the restart: {loads}"
        assert min(after) > max(before, default=-1), (i, last.run, before, after)
        # none older than the checkpoint the trainer resumed from (which it announces again: a
        # replica that missed it, the kill having come as it was published, loads it now), and
        # one trained after the restart
        resumed = system.resumed_from[last.run]
        assert min(after) >= resumed and max(after) > resumed, (i, last.run, resumed, after)


async def test_trainer_crash_between_checkpoint_and_step_log(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """Mid-checkpoint: the trainer dies right after the first checkpoint is renamed into place,
    before the step log, WeightsReady, progress and acks follow (PLEXRL_FAULT
    ``trainer.checkpoint``); then a SIGKILL at a drawn step of the restarted one."""
    spec = f"trainer.checkpoint@run_a:{CHECKPOINT - 1}"
    crash = Fault("trainer", crash=spec, restart_after=rng.uniform(0.2, 2.0))
    later = _kills(rng, "trainer", "run_a", [rng.randint(CHECKPOINT + 1, STEPS - 2)])
    system = make_system(tmp_path, tiny_model, steps=STEPS, trainer_env={"PLEXRL_FAULT": spec})
    await run_scenario(system, [crash, *later])
    # the restart found the checkpoint ahead of the log and logged its steps, none twice
    recovered = [r["step"] for r in read_step_log(system.out, "run_a") if r.get("recovered")]
    assert recovered[:CHECKPOINT] == list(range(CHECKPOINT)), recovered
    _check_resumed_at_checkpoints(system)
    print(f"trainer recoveries (restart -> next step trained): {_recoveries(system, 'trainer')}")


async def test_sigkill_one_of_two_inference_replicas_mid_generation(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """Each replica once at a fixed step (early, then late), and a drawn one at a drawn step."""
    points = [(2, 0), (STEPS - 4, 1), (rng.randint(3, STEPS - 5), rng.randrange(2))]
    faults = [
        Fault(
            f"inference-{replica}",
            run="run_a",
            at_step=at,
            trigger="generated",
            restart_after=rng.uniform(1.0, 4.0),
        )
        for at, replica in sorted(points)
    ]
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS, replicas=2), faults)


async def test_sigkill_orchestrator(tmp_path: Path, tiny_model: Path, rng: random.Random) -> None:
    faults = _kills(
        rng, "orchestrator-run_a", "run_a", _points(rng, (2, STEPS - 3), 3, 8), trigger="generated"
    )
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS), faults)


async def test_sigkill_registry(tmp_path: Path, tiny_model: Path, rng: random.Random) -> None:
    faults = _kills(
        rng, "registry", "run_b", _points(rng, (2, STEPS - 3), 3, 8), restart=(0.2, 3.0)
    )
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS), faults)


async def test_sigkill_nats_server_and_restart_on_the_same_store(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    faults = _kills(rng, "nats", "run_a", _points(rng, (2, STEPS - 3), 3, 8), restart=(1.0, 4.0))
    system = make_system(tmp_path, tiny_model, steps=STEPS)
    await run_scenario(system, faults)
    print(f"recoveries after the nats-server restarts: {_recoveries(system, 'nats')}")


@pytest.mark.slow
async def test_two_faults_at_once_trainer_and_nats(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """The issue's case: the trainer dies, the nats-server dies while it is down, and the
    trainer comes back while the server is still down (it must wait for it)."""
    trainer = Fault("trainer", run="run_a", at_step=6, restart_after=1.0)
    nats = Fault("nats", after=0.3, restart_after=rng.uniform(3.0, 6.0))
    system = make_system(tmp_path, tiny_model, steps=STEPS)
    await run_scenario(system, [trainer, nats])
    print(f"recovery with the nats-server down meanwhile: {system.recoveries}")


@pytest.mark.slow
async def test_two_faults_at_once_orchestrator_and_inference(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    faults = [
        Fault("orchestrator-run_b", run="run_b", at_step=5, trigger="generated", restart_after=1.5),
        Fault(f"inference-{rng.randrange(2)}", after=0.0, restart_after=rng.uniform(0.5, 2.0)),
    ]
    await run_scenario(make_system(tmp_path, tiny_model, steps=STEPS, replicas=2), faults)


@pytest.mark.slow
async def test_two_faults_at_once_registry_and_orchestrator(
    tmp_path: Path, tiny_model: Path, rng: random.Random
) -> None:
    """The orchestrator comes back while the registry is still down: it finds its run in the
    run table and resumes without the registry's admission."""
    faults = [
        Fault(
            "registry",
            run="run_a",
            at_step=5,
            trigger="generated",
            restart_after=rng.uniform(4.0, 8.0),
        ),
        Fault("orchestrator-run_a", after=0.0, restart_after=0.5),
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
