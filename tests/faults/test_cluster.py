"""The system on a three-server JetStream cluster: streams, buckets and the object store have
three replicas (``PLEXRL_STREAM_REPLICAS=3``) and every service is given all three servers.

One server SIGKILLed mid-run: the other two keep a quorum, every stream elects a new leader
where it must, clients move to a live server, and the runs finish with the usual invariants.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from .harness import Fault, System, run_config
from .scenarios import RUNS, run_scenario

pytestmark = pytest.mark.timeout(300)

STEPS = 8
SERVERS = 3


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
