"""The run loop against a real registry and a scripted replica on a real nats-server.

The replica answers sample ``k`` of each prompt with the first ``k`` characters of the right
answer, so every reward and advantage below is known in advance; test_orch_inference.py runs
the loop against the real inference service.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from schemas.records import Progress
from schemas.subjects import ROLLOUTS_STREAM, rollouts_subject
from services.bus import Bus
from services.envs import Prompt, ReverseEnv, load_environment, prompt_token_ids
from services.orchestrator import rollouts
from services.orchestrator.run_loop import OrchestratorResult, RunOrchestrator
from services.orchestrator.state import (
    OrchestratorCheckpoint,
    read_checkpoint,
    write_checkpoint,
)
from services.registry.service import Registry
from services.runs.progress import write_progress

from .conftest import RUN, RegistryFactory, orch_config
from .replica import (
    ScriptedReplica,
    announce,
    eventually,
    published_steps,
    read_metrics,
    rollout_batches,
)

ENV = load_environment("reverse", seed=7)


def orchestrator(obus: Bus, out: Path, tokenizer: Any, **kw: Any) -> RunOrchestrator:
    config = kw.pop("config", None) or orch_config()
    return RunOrchestrator(
        obus, RUN, config, output_dir=out, tokenizer=tokenizer, request_timeout=5.0, **kw
    )


def start(orch: RunOrchestrator) -> tuple[asyncio.Task[OrchestratorResult], asyncio.Event]:
    stop = asyncio.Event()
    return asyncio.create_task(orch.run(stop)), stop


async def steps_are(obus: Bus, expected: list[int], timeout: float = 15.0) -> None:
    async def check() -> bool:
        return await published_steps(obus, RUN) == expected

    await eventually(check, timeout)


def expected_rewards(step: int, batch_size: int = 2, group_size: int = 2) -> list[float]:
    """Sample k answers the first k characters right: reward 1 when that is the whole target,
    else half its position accuracy, 0.5 * k / len(target)."""
    out = []
    for j in range(batch_size):
        n = len(ENV.prompt(step * batch_size + j).target)
        out += [1.0 if k >= n else 0.5 * k / n for k in range(group_size)]
    return out


async def test_publishes_contiguous_scored_steps(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    orch = orchestrator(
        obus, out, tokenizer, config=orch_config(max_async_level=3), wait_for_training=False
    )
    result = await asyncio.wait_for(orch.run(asyncio.Event()), 30)
    assert (result.status, result.exit_code, result.next_step, result.steps_published) == (
        "done",
        0,
        3,
        3,
    )
    assert registry.records[RUN].status == "active"  # the orchestrator submitted it
    batches = await rollout_batches(obus, RUN)
    assert [b.step for b in batches] == [0, 1, 2]
    for batch in batches:
        assert batch.policy_version == 0
        assert len(batch.samples) == 4  # batch_size * group_size
        rewards = [s.reward for s in batch.samples]
        assert rewards == pytest.approx(expected_rewards(batch.step))
        assert all(0.0 <= r <= 1.0 for r in rewards)
        for g in range(2):
            group = batch.samples[2 * g : 2 * g + 2]
            assert sum(s.advantage for s in group) == pytest.approx(0.0, abs=1e-9)
            assert group[1].advantage == pytest.approx((group[1].reward - group[0].reward) / 2)
            expected_ids = prompt_token_ids(tokenizer, ENV.prompt(batch.step * 2 + g).text)
            assert group[0].prompt_ids == expected_ids and expected_ids[0] == tokenizer.bos_token_id
    # one request per prompt, each with the step's bound and a reproducible seed
    assert sorted(
        (r.request_id, r.seed, r.min_policy_version, r.n) for r in replica.requests
    ) == sorted(
        (f"{RUN}/step_{s}/prompt_{i}", rollouts.request_seed(7, s, i), 0, 2)
        for s in range(3)
        for i in (2 * s, 2 * s + 1)
    )
    rows = read_metrics(out / RUN / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["policy_lag"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert row["reward_mean"] == pytest.approx(sum(expected_rewards(row["step"])) / 4, abs=1e-6)
        assert row["num_samples"] == 4 and row["generation_s"] > 0
    checkpoint = read_checkpoint(out / RUN / "checkpoints" / "orchestrator.json")
    assert checkpoint is not None
    assert (checkpoint.next_step, checkpoint.next_prompt_index) == (3, 6)


async def test_stays_within_max_async_level_of_the_announced_version(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    task, _ = start(orchestrator(obus, out, tokenizer, config=orch_config(max_steps=4)))
    await steps_are(obus, [0, 1])
    await asyncio.sleep(0.5)  # no trainer: step 2 needs version 1
    assert await published_steps(obus, RUN) == [0, 1] and not task.done()

    await announce(obus, RUN, 1)
    await steps_are(obus, [0, 1, 2])
    assert {r.min_policy_version for r in replica.requests if "/step_2/" in r.request_id} == {1}
    await asyncio.sleep(0.3)
    assert await published_steps(obus, RUN) == [0, 1, 2]

    await announce(obus, RUN, 2)
    await steps_are(obus, [0, 1, 2, 3])
    await asyncio.sleep(0.3)
    assert not task.done()  # every step published; waits for the trainer to finish
    await announce(obus, RUN, 4)
    result = await asyncio.wait_for(task, 10)
    assert (result.status, result.policy_version) == ("done", 4)
    batches = await rollout_batches(obus, RUN)
    assert [b.policy_version for b in batches[2:]] == [1, 2]
    lags = [r["policy_lag"] for r in read_metrics(out / RUN / "metrics.jsonl")]
    assert lags == [0, 1, 1, 1]


async def test_max_async_level_zero_is_synchronous(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    config = orch_config(max_async_level=0, max_steps=2)
    task, _ = start(orchestrator(obus, out, tokenizer, config=config))
    await steps_are(obus, [0])
    await asyncio.sleep(0.5)
    assert await published_steps(obus, RUN) == [0]
    await announce(obus, RUN, 1)
    await steps_are(obus, [0, 1])
    await announce(obus, RUN, 2)
    result = await asyncio.wait_for(task, 10)
    assert result.status == "done"
    assert [b.policy_version for b in await rollout_batches(obus, RUN)] == [0, 1]


async def test_eviction_cancels_in_flight_generation(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    task, _ = start(orchestrator(obus, out, tokenizer, config=orch_config(max_async_level=0)))
    await steps_are(obus, [0])
    replica.delay = 30.0  # step 1's requests will hang
    await announce(obus, RUN, 1)
    await eventually(lambda: _async(any("/step_1/" in r.request_id for r in replica.requests)))
    assert await registry.evict(RUN, "diverged: loss is nan", requested_by="trainer")
    result = await asyncio.wait_for(task, 5)
    assert (result.status, result.exit_code) == ("evicted", 3)
    assert result.reason == "diverged: loss is nan"
    assert result.next_step == 1
    assert await published_steps(obus, RUN) == [0]


async def test_an_evicted_run_is_not_resubmitted(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    task, _ = start(orchestrator(obus, out, tokenizer, config=orch_config(max_async_level=0)))
    await steps_are(obus, [0])
    await registry.evict(RUN, "operator said so")
    assert (await asyncio.wait_for(task, 5)).status == "evicted"
    again = await asyncio.wait_for(orchestrator(obus, out, tokenizer).run(asyncio.Event()), 5)
    assert (again.status, again.reason, again.steps_published) == ("evicted", "operator said so", 0)


async def test_a_config_the_registry_rejects_exits_with_its_error(
    obus: Bus, out: Path, tokenizer: Any, make_registry: RegistryFactory
) -> None:
    await make_registry(max_async_level=0)
    result = await asyncio.wait_for(orchestrator(obus, out, tokenizer).run(asyncio.Event()), 10)
    assert (result.status, result.exit_code) == ("rejected", 2)
    assert "max_async_level" in result.reason
    assert await published_steps(obus, RUN) == []


async def test_another_config_for_a_held_run_is_refused(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    first = orchestrator(
        obus, out, tokenizer, config=orch_config(max_steps=1), wait_for_training=False
    )
    assert (await asyncio.wait_for(first.run(asyncio.Event()), 10)).status == "done"
    other = orchestrator(obus, out, tokenizer, config=orch_config(max_steps=1, seed=8))
    result = await asyncio.wait_for(other.run(asyncio.Event()), 10)
    assert result.status == "rejected"
    assert "already exists with a different config" in result.reason


async def test_stop_finishes_the_step_in_flight_then_checkpoints(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    replica.delay = 0.4
    task, stop = start(
        orchestrator(obus, out, tokenizer, config=orch_config(max_async_level=5, max_steps=5))
    )
    await eventually(lambda: _async(any("/step_1/" in r.request_id for r in replica.requests)))
    stop.set()
    result = await asyncio.wait_for(task, 10)
    assert (result.status, result.exit_code, result.next_step) == ("stopped", 0, 2)
    assert await published_steps(obus, RUN) == [0, 1]
    checkpoint = read_checkpoint(out / RUN / "checkpoints" / "orchestrator.json")
    assert checkpoint is not None and checkpoint.next_step == 2


async def test_resume_after_a_crash_between_publish_and_checkpoint(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    config = orch_config(max_steps=4)
    task, stop = start(orchestrator(obus, out, tokenizer, config=config))
    await steps_are(obus, [0, 1])
    stop.set()
    assert (await asyncio.wait_for(task, 5)).next_step == 2
    # As if killed after publishing step 1 but before checkpointing it.
    path = out / RUN / "checkpoints" / "orchestrator.json"
    old = read_checkpoint(path)
    assert old is not None and old.next_step == 2
    write_checkpoint(path, OrchestratorCheckpoint(**{**_fields(old), "next_step": 1}))
    for version in (1, 2):  # the trainer trains on steps 0 and 1 meanwhile
        await announce(obus, RUN, version)
    task, _ = start(orchestrator(obus, out, tokenizer, config=config))
    await steps_are(obus, [0, 1, 2, 3])
    for version in (3, 4):
        await announce(obus, RUN, version)
    result = await asyncio.wait_for(task, 15)
    assert (result.status, result.steps_published) == ("done", 2)
    assert await published_steps(obus, RUN) == [0, 1, 2, 3]  # each step stored once
    assert [r["step"] for r in read_metrics(out / RUN / "metrics.jsonl")] == [0, 1, 2, 3]


async def test_resume_from_the_trainer_progress_alone(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    config = orch_config(max_steps=4)
    task, stop = start(orchestrator(obus, out, tokenizer, config=config))
    await steps_are(obus, [0, 1])
    stop.set()
    await asyncio.wait_for(task, 5)
    # Checkpoint lost and batches expired from the stream: only the trainer remembers.
    (out / RUN / "checkpoints" / "orchestrator.json").unlink()
    await obus.js.purge_stream(ROLLOUTS_STREAM, subject=rollouts_subject(RUN))
    await write_progress(obus, RUN, Progress(step=2, total_tokens=10, total_samples=8))
    for version in (1, 2):
        await announce(obus, RUN, version)
    task, _ = start(orchestrator(obus, out, tokenizer, config=config))
    await steps_are(obus, [2, 3])
    for version in (3, 4):
        await announce(obus, RUN, version)
    assert (await asyncio.wait_for(task, 15)).status == "done"
    assert await published_steps(obus, RUN) == [2, 3]


def _fields(checkpoint: OrchestratorCheckpoint) -> dict[str, Any]:
    return {f: getattr(checkpoint, f) for f in checkpoint.__struct_fields__}


async def _async(value: bool) -> bool:
    return value


async def test_a_final_inference_error_fails_the_run(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    replica.errors = ["prompts[0] holds token id 999, outside the model's vocabulary"]
    result = await asyncio.wait_for(orchestrator(obus, out, tokenizer).run(asyncio.Event()), 10)
    assert (result.status, result.exit_code, result.next_step) == ("failed", 1, 0)
    assert "outside the model's vocabulary" in result.reason
    assert await published_steps(obus, RUN) == []


class _NanEnv(ReverseEnv):
    def score(self, prompt: Prompt, completion_text: str) -> float:
        return float("nan")


async def test_an_environment_that_cannot_score_fails_the_run(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    orch = orchestrator(obus, out, tokenizer, env=_NanEnv(seed=7))
    result = await asyncio.wait_for(orch.run(asyncio.Event()), 10)
    assert (result.status, result.exit_code) == ("failed", 1)
    assert "environment 'reverse' failed to score step 0" in result.reason
    assert "rewards must be finite" in result.reason
    assert await published_steps(obus, RUN) == []
