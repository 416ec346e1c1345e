"""The run loop against the real inference service (torch engine, tiny model) and registry.

The tiny model is not pretrained here: its rewards are near zero, which is fine, since these
tests are about the loop and the off-policy bound, not about learning.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from schemas.events import LoraSpec
from services.bus import Bus, EmbeddedNats
from services.envs import load_environment
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine
from services.model.loader import load_model
from services.model.lora import DEFAULT_TARGET_MODULES, MultiLoRA
from services.orchestrator import rollouts
from services.orchestrator.client import GenerateClient
from services.orchestrator.run_loop import RunOrchestrator
from services.registry.service import Registry
from services.weights import WeightPublisher

from .conftest import RUN, orch_config
from .replica import eventually, published_steps, rollout_batches

TARGETS = list(DEFAULT_TARGET_MODULES)
RANK, ALPHA = 4, 8.0


@pytest.fixture
async def inference(server: EmbeddedNats, tiny_dir: Path, out: Path) -> AsyncIterator[Any]:
    bus = await Bus.connect(server.url, "inference")
    engine = TorchEngine(tiny_dir, max_runs=4, max_lora_rank=8, target_modules=TARGETS)
    service = InferenceService(bus, engine, max_runs=4, replica_name="orch-test", output_dir=out)
    await service.start()
    yield service
    await service.stop()
    await bus.close()


def _config(**overrides: Any) -> Any:
    return orch_config(model={"lora": {"rank": RANK, "alpha": ALPHA}}, **overrides)


async def test_real_inference_contiguous_steps(
    obus: Bus,
    out: Path,
    tiny_dir: Path,
    registry: Registry,
    inference: InferenceService,
) -> None:
    _, tokenizer = load_model(tiny_dir)
    config = _config(max_async_level=2, max_steps=3)
    orch = RunOrchestrator(
        obus,
        RUN,
        config,
        output_dir=out,
        tokenizer=tokenizer,
        request_timeout=20.0,
        wait_for_training=False,
    )
    result = await asyncio.wait_for(orch.run(asyncio.Event()), 60)
    assert (result.status, result.next_step) == ("done", 3)
    batches = await rollout_batches(obus, RUN)
    assert [b.step for b in batches] == [0, 1, 2]
    for batch in batches:
        assert batch.policy_version == 0
        assert len(batch.samples) == 4
        for g in range(2):
            group = batch.samples[2 * g : 2 * g + 2]
            assert sum(s.advantage for s in group) == pytest.approx(0.0, abs=1e-6)
        for s in batch.samples:
            assert 0.0 <= s.reward <= 1.0
            assert 1 <= len(s.completion_ids) <= 4
            assert len(s.completion_logprobs) == len(s.completion_ids)
            assert all(lp <= 0.0 for lp in s.completion_logprobs)
    # The seeds make a step reproducible: asking again gives the same tokens.
    env = load_environment("reverse", seed=7)
    planned = rollouts.plan_step(env, tokenizer, 1, 2)
    again = await GenerateClient(obus, timeout=20.0).generate(
        rollouts.build_request(RUN, config, 1, planned[0], 0, 10.0)
    )
    assert [c.token_ids for c in again.completions[0]] == [
        s.completion_ids for s in batches[1].samples[:2]
    ]


async def test_real_inference_async_bound_with_published_adapters(
    obus: Bus,
    out: Path,
    tiny_dir: Path,
    registry: Registry,
    inference: InferenceService,
) -> None:
    model, tokenizer = load_model(tiny_dir)
    lora = MultiLoRA.attach(model, n_adapters=1, max_rank=8)
    publisher = WeightPublisher(obus, out)
    spec = LoraSpec(rank=RANK, alpha=ALPHA, target_modules=TARGETS)
    orch = RunOrchestrator(
        obus, RUN, _config(max_steps=3), output_dir=out, tokenizer=tokenizer, request_timeout=20.0
    )
    task = asyncio.create_task(orch.run(asyncio.Event()))

    async def steps(expected: list[int]) -> bool:
        return await published_steps(obus, RUN) == expected

    await eventually(lambda: steps([0, 1]), 30)
    await asyncio.sleep(0.5)  # no trainer: step 2 needs policy version 1
    assert await published_steps(obus, RUN) == [0, 1] and not task.done()

    idx = registry.idx_of(RUN)
    assert idx is not None
    lora.reset_slot(0, RANK, ALPHA, seed=1)
    await publisher.publish(RUN, idx, 1, lora.slot_state_dict(0), spec)
    await eventually(lambda: steps([0, 1, 2]), 30)
    assert (await rollout_batches(obus, RUN))[2].policy_version == 1
    assert not task.done()  # waits for the trainer to announce version 3
    for version in (2, 3):
        lora.reset_slot(0, RANK, ALPHA, seed=version)
        await publisher.publish(RUN, idx, version, lora.slot_state_dict(0), spec)
    result = await asyncio.wait_for(task, 30)
    assert (result.status, result.policy_version) == ("done", 3)
