"""Evictions under load: many orchestrators in one process (as ``plexrl sweep`` drives them),
their requests answered as fast as a replica can, all evicted at once; each must end with
status ``evicted``.

This is the loop that found why an evicted run's orchestrator sometimes went on: the eviction
cancels the step in flight, and Python 3.11's ``asyncio.wait_for`` (with which nats-py awaits
every reply) loses a cancellation that arrives in the same turn of the event loop as the reply.
The step then retried the requests of a run inference no longer knew, for ever. Under two busy
cores it happened in about one round in ten; the run loop now cancels again a task that goes on.

``PLEXRL_EVICTION_ROUNDS`` sets the rounds (default 2); ``PLEXRL_EVICTION_ROUNDS=50
scripts/loop_under_load.sh 1 tests/orchestrator/test_eviction_load.py`` runs 50 with every core
kept busy.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import pytest
from nats.aio.msg import Msg

from schemas.codec import decode, encode
from schemas.events import GenerateRequest, GenerateResponse
from schemas.subjects import GENERATE, INFERENCE_QUEUE_GROUP
from services.bus import Bus, EmbeddedNats, flushed
from services.orchestrator.run_loop import OrchestratorResult, RunOrchestrator, _race
from services.registry.service import Registry

from .conftest import RegistryFactory, orch_config
from .replica import answer_prefix_completion

RUNS = 6
ROUNDS = int(os.environ.get("PLEXRL_EVICTION_ROUNDS", "2"))
ACTED_WITHIN = 60.0
"""seconds every orchestrator has to act on its RunEvicted; it takes well under one, and an
orchestrator that missed it never ends at all"""

pytestmark = pytest.mark.timeout(120 + 60 * ROUNDS)


class FastReplica:
    """Answers every request at once; a run it was told is gone gets the error a real replica
    sends for a run it does not know (which the orchestrator retries)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.gone: set[str] = set()
        self.answered = 0

    async def start(self) -> FastReplica:
        await self.bus.nc.subscribe(GENERATE, queue=INFERENCE_QUEUE_GROUP, cb=self._on_request)
        await flushed(self.bus.nc)
        return self

    async def _on_request(self, msg: Msg) -> None:
        req: GenerateRequest = decode(msg.data, GenerateRequest)
        self.answered += 1
        if req.run_id in self.gone:
            error = f"unknown run {req.run_id}: no run with this id is registered here"
            completions = []
        else:
            error = None
            completions = [
                [answer_prefix_completion(p, k, req.max_tokens) for k in range(req.n)]
                for p in req.prompts
            ]
        response = GenerateResponse(
            request_id=req.request_id,
            run_id=req.run_id,
            policy_version=0,
            completions=completions,
            error=error,
        )
        await msg.respond(encode(response))


async def _round(
    bus: Bus, registry: Registry, replica: FastReplica, out: Path, tokenizer: Any, n: int
) -> tuple[list[OrchestratorResult], float]:
    # never waiting for a policy version: requests are in flight all the time
    config = orch_config(max_steps=100_000, max_async_level=64, batch_size=8, group_size=2)
    stops = {f"run_evict{n}_{i}": asyncio.Event() for i in range(RUNS)}
    tasks = {
        run_id: asyncio.create_task(
            RunOrchestrator(
                bus, run_id, config, output_dir=out, tokenizer=tokenizer, wait_for_training=False
            ).run(stop),
            name=run_id,
        )
        for run_id, stop in stops.items()
    }
    while sum(r in registry.records for r in stops) < RUNS or replica.answered < 50 * RUNS * n:
        await asyncio.sleep(0.1)
    evicted = time.monotonic()
    for run_id in stops:
        replica.gone.add(run_id)
        assert await registry.evict(run_id, "evicted under load", requested_by="test")
    _, going_on = await asyncio.wait(tasks.values(), timeout=ACTED_WITHIN)
    took = time.monotonic() - evicted
    for stop in stops.values():  # whatever went on, end it, then say what it was
        stop.set()
    await asyncio.wait(tasks.values(), timeout=30)
    assert not going_on, f"round {n}: not acting on RunEvicted: {[t.get_name() for t in going_on]}"
    return [t.result() for t in tasks.values()], took


async def test_every_orchestrator_acts_on_its_eviction_under_load(
    server: EmbeddedNats, out: Path, tokenizer: Any, make_registry: RegistryFactory
) -> None:
    registry = await make_registry(max_runs=RUNS)
    rbus = await Bus.connect(server.url, "inference")
    obus = await Bus.connect(server.url, "orchestrator")
    try:
        replica = await FastReplica(rbus).start()
        for n in range(1, ROUNDS + 1):
            results, took = await _round(obus, registry, replica, out, tokenizer, n)
            assert [(r.status, r.reason) for r in results] == [
                ("evicted", "evicted under load")
            ] * RUNS
            print(f"round {n}: {RUNS} orchestrators evicted, all ended {took:.2f}s after the first")
    finally:
        await obus.close()
        await rbus.close()


async def test_a_step_that_loses_its_cancellation_is_cancelled_again() -> None:
    """What the lost cancellation does to a step, in miniature: the first CancelledError never
    reaches it (here it swallows it, as wait_for does), and it goes on waiting."""
    lost = 0

    async def step() -> None:
        nonlocal lost
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            lost += 1
        await asyncio.sleep(3600)

    evicted = asyncio.Event()
    evicted.set()
    finished, _ = await asyncio.wait_for(_race(step(), evicted.wait()), 30)
    assert (finished, lost) == (False, 1)
