"""One scenario from start to checks, and the randomized schedules of ``--soak``."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from pathlib import Path

from .harness import Fault, System, run_config
from .invariants import check_nothing_left, check_recorded, listening_ports
from .timing import RECOVERIES

RUNS = ("run_a", "run_b")


@dataclass
class Outcome:
    system: System
    seconds: float


def make_system(
    root: Path,
    model: Path,
    *,
    steps: int,
    replicas: int = 1,
    seed: int = 0,
    trainer_env: dict[str, str] | None = None,
) -> System:
    runs = {run_id: run_config(steps, seed + i) for i, run_id in enumerate(RUNS)}
    return System(root, model, runs, replicas=replicas, trainer_env=trainer_env)


async def run_scenario(
    system: System, faults: list[Fault], *, allow_skips: bool = False
) -> Outcome:
    """Start ``system``, apply ``faults`` while the runs train, check every invariant, stop it
    and check that nothing is left; the scenario's wall time. ``allow_skips`` lets a fault on an
    orchestrator whose run finished first go unapplied (randomized schedules)."""
    started = time.monotonic()
    pids: list[int] = []
    ports: set[int] = set()
    try:
        await system.start()
        await system.run(faults)
        assert system.nats.proc is not None
        servers = system.cluster.pids() if system.cluster else [system.nats.proc.pid]
        pids = [*servers, *(pid for p in system.procs.values() for pid in p.pids)]
        ports = listening_ports(pids)
        assert system.nats.port in ports, f"ports found listening: {ports}"
        await check_recorded(system)
    except BaseException:
        print(system.tails(), flush=True)
        raise
    finally:
        codes = await system.stop()
    for name, code in codes.items():
        # a service stopped by SIGTERM exits 0; an orchestrator exited 0 when its run was done
        assert code == 0, f"{name} stopped with {code}\n{system.procs[name].tail(80)}"
    check_nothing_left(system, ports)
    seconds = time.monotonic() - started
    for fault in faults:
        if fault.skipped and allow_skips:
            continue
        assert fault.killed_at is not None and fault.restarted_at is not None, fault.describe()
    system.log(f"scenario passed in {seconds:.1f}s")
    for kind, took in system.recoveries.items():
        if took:
            system.log(f"recovery ({RECOVERIES[kind]}): {', '.join(f'{t:.1f}s' for t in took)}")
    return Outcome(system, seconds)


COMMIT_POINTS = ("train", "checkpoint", "publish", "progress", "ack")


def random_faults(
    rng: random.Random, steps: int, replicas: int
) -> tuple[list[Fault], dict[str, str]]:
    """A random schedule and the trainer's environment for it: one to three SIGKILLs on random
    targets at random steps, in step order, each maybe followed at once by a second one (two
    faults at once); and sometimes first a trainer crash at a commit point (``PLEXRL_FAULT``)."""
    targets = ["trainer", "registry", "nats", *(f"orchestrator-{r}" for r in RUNS)]
    targets += [f"inference-{i}" for i in range(replicas)]

    def sigkill(at_step: int, after: float | None = None) -> Fault:
        target = rng.choice(targets)
        own = target.removeprefix("orchestrator-")
        run = own if own in RUNS else rng.choice(RUNS)
        trigger = "generated" if target.startswith(("orchestrator", "inference")) else "trained"
        restart = round(rng.uniform(0.2, 3.0), 1)
        return Fault(
            target, run=run, at_step=at_step, trigger=trigger, after=after, restart_after=restart
        )

    faults = [sigkill(rng.randint(1, steps - 2)) for _ in range(rng.randint(1, 3))]
    faults.sort(key=lambda f: f.at_step)
    for i in reversed(range(len(faults))):
        if rng.random() < 0.3:
            faults.insert(i + 1, sigkill(0, after=round(rng.uniform(0.0, 1.5), 1)))
    env: dict[str, str] = {}
    if rng.random() < 0.3:
        # early, so that the SIGKILLs (which wait for it) still come while the runs train
        point, ckpt = rng.choice(COMMIT_POINTS), rng.choice([4, 8])
        step = ckpt - 1 if point in ("checkpoint", "ack") else rng.randint(0, ckpt - 1)
        spec = env["PLEXRL_FAULT"] = f"trainer.{point}@{rng.choice(RUNS)}:{step}"
        faults.insert(
            0, Fault("trainer", crash=spec, restart_after=round(rng.uniform(0.2, 2.0), 1))
        )
    return faults, env
