"""At lag 0 the trainer's importance ratio is 1 for every sampling setting a run is admitted with.

Completions come from the inference sampler (services/model/sampling.py, what the torch engine
runs) on the tiny model through a fresh adapter slot, with the log-probabilities it reports.
The trainer then trains on them as a RolloutBatch through its own path (packer, forward at the
run's temperature, ``token_loss``). The run's loss is ``mask`` with bounds of 1e-3 on either
side, so the step's ``num_clipped`` counts exactly the tokens whose ratio is off by more than
1e-3: it must be 0. A run whose config names another temperature than the one sampled is the
control: there the count is not 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trainer_support import Parts, run_config

from schemas.config import orch_config_from_dict
from schemas.events import RolloutBatch, Sample
from services.model.sampling import SequenceSpec, eos_token_ids, generate_batch

TOLERANCE = 1e-3
SLOT = 1
PROMPTS = [[1, 20, 31, 42], [1, 50, 9], [1, 77, 13, 64, 25], [1, 5]]
"""Token ids of the tiny model's vocabulary, each starting with <bos> (id 1)."""


def _sampled_batch(parts: Parts, temperature: float) -> RolloutBatch:
    specs = [
        SequenceSpec(p, slot=SLOT, max_tokens=12, temperature=temperature, seed=100 * i + k)
        for i, p in enumerate(PROMPTS)
        for k in range(3)
    ]
    outputs = generate_batch(
        parts.model, parts.lora, specs, eos_ids=eos_token_ids(parts.model), pad_id=parts.pad_id
    )
    samples = [
        Sample(
            prompt_ids=list(spec.prompt_ids),
            completion_ids=out.token_ids,
            completion_logprobs=out.logprobs,
            reward=0.0,
            advantage=1.0 if i % 2 else -1.0,
        )
        for i, (spec, out) in enumerate(zip(specs, outputs, strict=True))
    ]
    return RolloutBatch(run_id="run_lag0", step=0, policy_version=0, samples=samples)


def _config(temperature: float) -> dict[str, Any]:
    data = run_config(temperature=temperature)
    data["loss"] = {"mode": "mask", "clip_low": TOLERANCE, "clip_high": TOLERANCE}
    return data


def _train_once(tiny_dir: Path, sampled_at: float, trained_at: float) -> Any:
    parts = Parts(tiny_dir, max_runs=2, max_rank=8, budget=256)
    parts.add_run(SLOT, "run_lag0", orch_config_from_dict(_config(trained_at)))
    batch = _sampled_batch(parts, sampled_at)
    result = parts.step({SLOT: batch})[SLOT]
    assert result.trained, result.reason
    assert result.stats.num_tokens == sum(len(s.completion_ids) for s in batch.samples) > 12
    return result.stats


# The admitted range is (0, 10] with top_p = 1 (schemas/config.py SamplingConfig).
@pytest.mark.parametrize("temperature", [0.1, 0.5, 1.0, 1.7, 10.0])
def test_lag_zero_ratio_is_one_at_every_admitted_temperature(
    tiny_dir: Path, temperature: float
) -> None:
    stats = _train_once(tiny_dir, temperature, temperature)
    assert stats.num_clipped == 0
    assert 1.0 - TOLERANCE <= stats.ratio_max <= 1.0 + TOLERANCE
    assert stats.ratio_mean == pytest.approx(1.0, abs=TOLERANCE)


def test_a_temperature_mismatch_moves_the_ratio_off_one(tiny_dir: Path) -> None:
    # Sampled at 1.7, scored at 1.0: the same tokens are scored under a sharper distribution.
    stats = _train_once(tiny_dir, 1.7, 1.0)
    assert stats.num_clipped > stats.num_tokens // 2
