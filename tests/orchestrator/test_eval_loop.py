"""Held-out evaluation and dynamic sampling in the run loop, on a real nats-server and registry:
the evaluation against the real inference service (torch engine, tiny model), dynamic sampling
against the scripted replica, whose rewards are known in advance."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.bus import Bus, EmbeddedNats
from services.envs import Environment, EnvLoadError, Prompt, load_environment
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine
from services.model.loader import load_model
from services.model.lora import DEFAULT_TARGET_MODULES
from services.orchestrator.evaluation import pass_at_k
from services.orchestrator.run_loop import RunOrchestrator
from services.registry.service import Registry

from .conftest import RUN, orch_config
from .replica import ScriptedReplica, read_metrics, rollout_batches


@pytest.fixture
async def inference(server: EmbeddedNats, tiny_dir: Path, out: Path) -> AsyncIterator[Any]:
    bus = await Bus.connect(server.url, "inference")
    engine = TorchEngine(
        tiny_dir, max_runs=2, max_lora_rank=8, target_modules=list(DEFAULT_TARGET_MODULES)
    )
    service = InferenceService(bus, engine, max_runs=2, replica_name="eval-test", output_dir=out)
    await service.start()
    yield service
    await service.stop()
    await bus.close()


async def test_evaluation_writes_heldout_fields_against_real_inference(
    obus: Bus, out: Path, tiny_dir: Path, registry: Registry, inference: InferenceService
) -> None:
    _, tokenizer = load_model(tiny_dir)
    config = orch_config(
        max_steps=3,
        max_async_level=2,  # no trainer here
        model={"lora": {"rank": 4, "alpha": 8.0}},
        eval={
            "interval": 2,
            "num_prompts": 6,
            "pass_k": 2,
            "samples": 3,
            "base_temperatures": [0.5, 1.0],
        },
    )
    orch = RunOrchestrator(
        obus,
        RUN,
        config,
        output_dir=out,
        tokenizer=tokenizer,
        request_timeout=30.0,
        wait_for_training=False,
    )
    result = await asyncio.wait_for(orch.run(asyncio.Event()), 120)
    assert (result.status, result.next_step) == ("done", 3)

    base = json.loads((out / RUN / "heldout_base.json").read_text())["by_temperature"]
    assert set(base) == {"0.0", "0.5", "1.0"}
    best_t, best = max(base.items(), key=lambda kv: (kv[1], -float(kv[0])))

    rows = read_metrics(out / RUN / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "heldout_greedy" not in rows[0]
    for row in rows:
        assert {"entropy_mean", "zero_spread_frac"} <= row.keys()
        assert row["entropy_mean"] > 0  # sampled at temperature 1
        assert 0.0 <= row["zero_spread_frac"] <= 1.0
    for row in rows[1:]:  # step 1 (every 2 steps) and the last step
        assert row["eval_policy_version"] == 0  # no trainer: the policy is still the base
        assert row["base_best"] == pytest.approx(best, abs=1e-6)
        assert row["base_best_temperature"] == float(best_t)
        # greedy decoding of the unchanged policy is the base's greedy decoding
        assert row["heldout_greedy"] == pytest.approx(base["0.0"], abs=1e-6)
        assert row["heldout_greedy"] == row["base_greedy"]
        assert 0.0 <= row["heldout_pass_at_k"] <= 1.0 and row["pass_k"] == 2
        assert 0.0 <= row["heldout_sampled"] <= 1.0
    # evaluation stays off the rollout stream and out of the training samples
    batches = await rollout_batches(obus, RUN)
    assert [b.step for b in batches] == [0, 1, 2]
    assert all(len(b.samples) == 4 for b in batches)
    assert all(r["num_samples"] == 4 for r in rows)
    env = load_environment("reverse", seed=7)
    heldout = {
        tuple(tokenizer.encode(p.text, add_special_tokens=False)) for p in env.heldout_prompts(6)
    }
    trained = {tuple(s.prompt_ids[1:]) for b in batches for s in b.samples}
    assert trained and not trained & heldout


async def test_evaluation_values_against_known_answers(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    """Sample k of the scripted replica answers the first k characters (at most max_tokens = 4)
    of the reversed word: a greedy request (n = 1) gets the empty answer, and with 6 samples a
    word of length L is solved by the samples k >= L, so pass@k is known for each prompt."""
    config = orch_config(
        max_steps=2,
        max_async_level=2,
        eval={
            "interval": 5,
            "num_prompts": 10,
            "pass_k": 2,
            "samples": 6,
            "base_temperatures": [0.7],
        },
    )
    orch = RunOrchestrator(
        obus,
        RUN,
        config,
        output_dir=out,
        tokenizer=tokenizer,
        request_timeout=5.0,
        wait_for_training=False,
    )
    assert (await asyncio.wait_for(orch.run(asyncio.Event()), 30)).status == "done"
    prompts = load_environment("reverse", seed=7).heldout_prompts(10)
    lengths = [len(p.target) for p in prompts]
    # an exact answer earns 1, a prefix half its position accuracy (services/envs/strings.py)
    sampled = [[1.0 if min(k, 4) >= n else 0.5 * min(k, 4) / n for k in range(6)] for n in lengths]
    solved = [sum(r == 1.0 for r in row) for row in sampled]
    expected_pass = sum(pass_at_k(6, c, 2) for c in solved) / 10
    assert 0 < expected_pass < 1
    rows = read_metrics(out / RUN / "metrics.jsonl")
    assert "heldout_greedy" not in rows[0]
    last = rows[1]  # the last step only: the interval is longer than the run
    assert last["heldout_greedy"] == 0.0
    assert last["heldout_sampled"] == pytest.approx(sum(map(sum, sampled)) / 60, abs=1e-6)
    assert last["heldout_pass_at_k"] == pytest.approx(expected_pass, abs=1e-6)
    assert (last["base_best"], last["base_best_temperature"]) == (0.0, 0.0)
    evals = [r for r in replica.requests if "/eval_" in r.request_id]
    assert {(r.temperature, r.n) for r in evals} == {(0.0, 1), (0.7, 1), (1.0, 6)}
    # the base greedy and at T=0.7, the last step greedy and sampled: 10 prompts each
    assert sum(len(r.prompts) for r in evals) == 10 * 4
    assert {tuple(r.prompts[0]) for r in evals}.isdisjoint(
        tuple(r.prompts[0]) for r in replica.requests if "/step_" in r.request_id
    )


async def test_dynamic_sampling_replaces_groups_without_spread(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    """With one completion per prompt every group is flat: each round refills both prompts,
    and after the last round the step is published with the original (flat) groups."""
    config = orch_config(
        max_steps=1, group_size=1, advantage={"dynamic_sampling": True}, max_async_level=1
    )
    orch = RunOrchestrator(
        obus,
        RUN,
        config,
        output_dir=out,
        tokenizer=tokenizer,
        request_timeout=5.0,
        wait_for_training=False,
    )
    result = await asyncio.wait_for(orch.run(asyncio.Event()), 30)
    assert result.status == "done"
    ids = [r.request_id for r in replica.requests]
    assert len(ids) == 2 + 4 * 2  # the step's prompts, then 4 rounds of 2 refills
    assert {f"{RUN}/step_0/prompt_0", f"{RUN}/step_0/prompt_1"} <= set(ids)
    (batch,) = await rollout_batches(obus, RUN)
    env = load_environment("reverse", seed=7)
    assert [s.prompt_ids[1:] for s in batch.samples] == [
        tokenizer.encode(env.train_prompt(i).text, add_special_tokens=False) for i in (0, 1)
    ]
    (row,) = read_metrics(out / RUN / "metrics.jsonl")
    assert (row["zero_spread_frac"], row["dropped_groups"], row["num_samples"]) == (1.0, 10, 2)


async def test_dynamic_sampling_keeps_a_batch_that_has_spread(
    obus: Bus, out: Path, tokenizer: Any, registry: Registry, replica: ScriptedReplica
) -> None:
    """Sample k answers the first k characters right, so every group of two has spread."""
    config = orch_config(max_steps=2, advantage={"dynamic_sampling": True}, max_async_level=2)
    orch = RunOrchestrator(
        obus,
        RUN,
        config,
        output_dir=out,
        tokenizer=tokenizer,
        request_timeout=5.0,
        wait_for_training=False,
    )
    assert (await asyncio.wait_for(orch.run(asyncio.Event()), 30)).status == "done"
    assert len(replica.requests) == 4  # no refill
    rows = read_metrics(out / RUN / "metrics.jsonl")
    assert [(r["zero_spread_frac"], r["dropped_groups"]) for r in rows] == [(0.0, 0), (0.0, 0)]


class _Constant(Environment):
    name = "constant"

    def __init__(self, text: str) -> None:
        super().__init__(0)
        self.text = text

    def prompt(self, index: int) -> Prompt:
        return Prompt(self.text, "ok")

    def score(self, prompt: Prompt, completion_text: str) -> float:
        return float(completion_text == "ok")


def _constant(heldout: bool) -> _Constant:
    return next(
        env
        for env in (_Constant(f"say ok {k}:") for k in range(1000))
        if env.is_heldout(env.prompt(0)) == heldout
    )


def test_an_env_that_cannot_train_is_refused_and_one_without_heldout_prompts_is_not_evaluated(
    obus: Bus, out: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(EnvLoadError, match="every prompt it makes is held out"):
        RunOrchestrator(
            obus, RUN, orch_config(), output_dir=out, tokenizer=tokenizer, env=_constant(True)
        )
    config = orch_config(eval={"interval": 1, "num_prompts": 2})
    orch = RunOrchestrator(
        obus, RUN, config, output_dir=out, tokenizer=tokenizer, env=_constant(False)
    )
    assert not orch.evaluate
    assert "no held-out evaluation: environment 'constant': 0 held-out prompts" in caplog.text


async def test_no_base_evaluation_when_inference_no_longer_serves_the_base(
    obus: Bus,
    out: Path,
    tokenizer: Any,
    registry: Registry,
    replica: ScriptedReplica,
    caplog: pytest.LogCaptureFixture,
) -> None:
    replica.version = 1  # a replica that already holds a trained adapter for this run id
    config = orch_config(max_steps=1, eval={"interval": 1, "num_prompts": 4})
    orch = RunOrchestrator(
        obus,
        RUN,
        config,
        output_dir=out,
        tokenizer=tokenizer,
        request_timeout=5.0,
        wait_for_training=False,
    )
    assert (await asyncio.wait_for(orch.run(asyncio.Event()), 30)).status == "done"
    assert (
        "no base evaluation: inference answered with policy version 1, not the base" in caplog.text
    )
    (row,) = read_metrics(out / RUN / "metrics.jsonl")
    assert row["heldout_greedy"] == 0.0 and row["eval_policy_version"] == 1
    assert "base_best" not in row
    assert not (out / RUN / "heldout_base.json").exists()
