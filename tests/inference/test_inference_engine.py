"""The torch engine: batching across runs, and adapter swaps at generation-step boundaries."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from inference_support import LORA_TARGETS, lora_spec, random_adapter

from schemas.events import WeightsReady
from services.inference.jobs import Job, SlotChanged
from services.inference.torch_engine import TorchEngine
from services.model.sampling import SequenceSpec, generate_batch, sequence_seed

DIGEST = "sha256:" + "0" * 64


def _event(run_id: str, idx: int, step: int) -> WeightsReady:
    return WeightsReady(
        run_id=run_id,
        idx=idx,
        step=step,
        transport="object_store",
        location=f"{run_id}/step_{step}",
        digest=DIGEST,
        size_bytes=1,
        lora=lora_spec(),
    )


def _job(run_id: str, slot: int, max_tokens: int = 6, seed: int = 1, **kw: Any) -> Job:
    fields: dict[str, Any] = {
        "request_id": f"{run_id}-{seed}",
        "run_id": run_id,
        "slot": slot,
        "prompts": [[1, 10, 11], [1, 20]],
        "n": 2,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_version": 0,
        "seed": seed,
    }
    return Job(**(fields | kw))


def _loaded_version(engine: TorchEngine, slot: int) -> int | None:
    """The version the model itself holds in ``slot`` (staged versions do not count)."""
    assert engine.bank is not None
    state = engine.bank.loaded(slot)
    return None if state is None else state.version


@pytest.fixture
async def engine(tiny_dir: Path):
    eng = TorchEngine(
        tiny_dir, max_runs=3, max_lora_rank=8, target_modules=LORA_TARGETS, batch_window_ms=50
    )
    await eng.start()
    eng.add_run(0, "run_a", 4, 8.0)
    eng.add_run(1, "run_b", 4, 8.0)
    yield eng
    await eng.close()


async def test_jobs_of_several_runs_share_one_batch(engine: TorchEngine, scratch_lora) -> None:
    model, lora = scratch_lora
    adapter = random_adapter(lora, 0, 4, 8.0, seed=3)
    assert await engine.load_adapter(1, _event("run_b", 1, 1), adapter)
    batches = engine.num_batches
    a, b = await asyncio.gather(
        engine.generate(_job("run_a", 0)), engine.generate(_job("run_b", 1))
    )
    assert engine.num_batches == batches + 1
    assert (a.policy_version, b.policy_version) == (0, 1)
    assert [len(group) for group in b.completions] == [2, 2]
    # Completion j of prompt i used the seed the engine derives from (request seed, i, j); the
    # same sequence generated alone on the scratch model (same adapter) gives the same tokens.
    (ref,) = generate_batch(
        model,
        lora,
        [SequenceSpec([1, 20], slot=0, max_tokens=6, seed=sequence_seed(1, 1, 1))],
        eos_ids=engine.eos_ids,
        pad_id=engine.pad_id,
    )
    assert b.completions[1][1].token_ids == ref.token_ids
    assert b.completions[1][1].logprobs == pytest.approx(ref.logprobs, abs=1e-5)


async def test_a_swap_waits_for_the_slots_sequences_but_not_for_others(
    engine: TorchEngine, scratch_lora
) -> None:
    _, lora = scratch_lora
    # Long enough (no EOS: greedy on slot 0 of the base never stops early here) to be mid-batch.
    long_job = _job("run_a", 0, max_tokens=250, temperature=0.0, prompts=[[1, 10]], n=1)
    engine.eos_ids = []
    running = asyncio.create_task(engine.generate(long_job))
    while engine.num_batches == 0 or not engine._queue.empty():
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    # run_b's slot is idle in that batch: its new version lands between two decode steps.
    assert await engine.load_adapter(1, _event("run_b", 1, 1), random_adapter(lora, 0, 4, 8.0, 5))
    # run_a's own slot is busy: its version 1 must wait for the batch to finish.
    assert await engine.load_adapter(0, _event("run_a", 0, 1), random_adapter(lora, 0, 4, 8.0, 6))
    for _ in range(500):
        if _loaded_version(engine, 1) == 1:
            break
        await asyncio.sleep(0.005)
    assert _loaded_version(engine, 1) == 1
    assert not running.done(), "run_b's swap waited for run_a's batch"
    assert _loaded_version(engine, 0) == 0
    result = await running
    assert result.policy_version == 0
    assert len(result.completions[0][0].token_ids) == 250
    await asyncio.sleep(0.05)
    assert _loaded_version(engine, 0) == 1


async def test_staged_versions_count_and_older_ones_are_refused(engine: TorchEngine, scratch_lora):
    _, lora = scratch_lora
    adapter = random_adapter(lora, 0, 4, 8.0, seed=9)
    assert await engine.load_adapter(0, _event("run_a", 0, 3), adapter)
    assert engine.available_version(0, "run_a") == 3
    assert not await engine.load_adapter(0, _event("run_a", 0, 2), adapter)
    assert engine.available_version(0, "run_a") == 3
    assert engine.available_version(0, "run_b") is None
    bad = {k: v for k, v in adapter.items() if "q_proj" not in k}
    with pytest.raises(ValueError, match="keys missing"):
        await engine.load_adapter(0, _event("run_a", 0, 4), bad)
    assert engine.available_version(0, "run_a") == 3


async def test_a_job_whose_slot_moved_on_is_handed_back(engine: TorchEngine) -> None:
    engine.remove_run(1, "run_b")
    with pytest.raises(SlotChanged):
        await engine.generate(_job("run_b", 1))
    engine.add_run(1, "run_c", 4, 8.0)
    with pytest.raises(SlotChanged):
        await engine.generate(_job("run_c", 1, min_version=2))
    assert (await engine.generate(_job("run_c", 1))).policy_version == 0


async def test_rank_above_the_maximum_is_refused(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match="max-lora-rank 16"):
        engine.add_run(2, "run_big", 16, 16.0)


async def test_a_job_joins_a_running_batch_and_leaves_before_it_ends(engine: TorchEngine) -> None:
    engine.eos_ids = []
    long_job = _job("run_a", 0, max_tokens=200, temperature=0.0, prompts=[[1, 10]], n=1)
    running = asyncio.create_task(engine.generate(long_job))
    while engine.num_batches == 0 or not engine._queue.empty():
        await asyncio.sleep(0.005)
    batches = engine.num_batches
    short = await engine.generate(_job("run_b", 1, max_tokens=5, seed=4))
    # It was served by the batch already running (no new batch), and came back while the long
    # job still decoded: it joined between two decode steps and left as soon as it finished.
    assert engine.num_batches == batches
    assert not running.done()
    assert [len(c.token_ids) for group in short.completions for c in group] == [5] * 4
    assert len((await running).completions[0][0].token_ids) == 200
    assert engine.generator is not None and not engine.generator.active


async def test_a_job_bigger_than_the_batch_joins_part_by_part_on_one_version(
    tiny_dir: Path, scratch_lora
) -> None:
    _, lora = scratch_lora
    engine = TorchEngine(
        tiny_dir, max_runs=2, max_lora_rank=8, target_modules=LORA_TARGETS, max_num_seqs=3
    )
    await engine.start()
    try:
        engine.eos_ids = []
        engine.add_run(0, "run_a", 4, 8.0)
        job = _job("run_a", 0, max_tokens=30, prompts=[[1, 10], [1, 20, 21]], n=4)
        running = asyncio.create_task(engine.generate(job))
        while engine.generator is None or not engine.generator.active:
            await asyncio.sleep(0.002)
        # A new version of the job's slot, announced while only part of the job is in: it must
        # wait for the whole job, which is served by version 0 alone.
        assert await engine.load_adapter(
            0, _event("run_a", 0, 1), random_adapter(lora, 0, 4, 8.0, 7)
        )
        result = await running
        assert result.policy_version == 0
        assert [[len(c.token_ids) for c in group] for group in result.completions] == [[30] * 4] * 2
        # The same sequences generated alone on the scratch model's version 0 (a fresh slot is
        # the base model): completion j of prompt i used seed (request seed, i, j).
        spec = SequenceSpec([1, 20, 21], slot=-1, max_tokens=30, seed=sequence_seed(1, 1, 3))
        (ref,) = generate_batch(*scratch_lora, [spec], eos_ids=[], pad_id=engine.pad_id)
        assert result.completions[1][3].token_ids == ref.token_ids
        for _ in range(200):
            if _loaded_version(engine, 0) == 1:
                break
            await asyncio.sleep(0.005)
        assert _loaded_version(engine, 0) == 1
    finally:
        await engine.close()
