"""Helpers of the trainer tests: run configs, rollout batches, in-process model parts."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from schemas.config import OrchConfig, orch_config_from_dict
from schemas.events import RolloutBatch, Sample
from services.model.loader import load_model
from services.model.lora import NO_ADAPTER, MultiLoRA
from services.trainer.loss import selected_logprobs
from services.trainer.state import RunState, create_run_state
from services.trainer.step import StepExecutor

VOCAB = 90


def run_config(
    *,
    rank: int = 4,
    alpha: float = 8.0,
    lr: float = 1e-2,
    interval: int = 50,
    kl_coef: float = 0.0,
    temperature: float = 1.0,
    eps: float = 1e-8,
    max_steps: int = 200,
    seed: int = 0,
) -> dict[str, Any]:
    """A run config as RunSubmitted carries it."""
    return {
        "max_steps": max_steps,
        "seed": seed,
        "model": {"lora": {"rank": rank, "alpha": alpha}},
        "optim": {"lr": lr, "eps": eps},
        "loss": {"kl_coef": kl_coef},
        "sampling": {"temperature": temperature},
        "ckpt": {"interval": interval, "keep": 2},
    }


def config(**kwargs: Any) -> OrchConfig:
    return orch_config_from_dict(run_config(**kwargs))


def make_batch(
    run_id: str,
    step: int,
    *,
    num_samples: int = 4,
    seed: int = 0,
    logprob: float = -4.0,
    advantage: float | None = None,
    max_prompt: int = 6,
    max_completion: int = 8,
) -> RolloutBatch:
    """Random token ids within the tiny vocabulary, deterministic in (run_id, step, seed)."""
    rng = random.Random(f"{run_id}/{step}/{seed}")
    samples = []
    for _ in range(num_samples):
        prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randint(2, max_prompt))]
        completion = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, max_completion))]
        samples.append(
            Sample(
                prompt_ids=prompt,
                completion_ids=completion,
                completion_logprobs=[logprob] * len(completion),
                reward=rng.random(),
                advantage=rng.uniform(-1.0, 1.0) if advantage is None else advantage,
            )
        )
    return RolloutBatch(run_id=run_id, step=step, policy_version=step, samples=samples)


def with_samples(batch: RolloutBatch, **changes: Any) -> RolloutBatch:
    """``batch`` with every sample's fields replaced by ``changes`` (callables get the sample)."""
    samples = []
    for s in batch.samples:
        fields = {k: (v(s) if callable(v) else v) for k, v in changes.items()}
        samples.append(
            Sample(
                prompt_ids=fields.get("prompt_ids", s.prompt_ids),
                completion_ids=fields.get("completion_ids", s.completion_ids),
                completion_logprobs=fields.get("completion_logprobs", s.completion_logprobs),
                reward=fields.get("reward", s.reward),
                advantage=fields.get("advantage", s.advantage),
            )
        )
    return RolloutBatch(
        run_id=batch.run_id, step=batch.step, policy_version=batch.policy_version, samples=samples
    )


def num_tokens(batch: RolloutBatch) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.samples)


@functools.cache
def _base_model(model_dir: Path) -> Any:
    """The tiny model as the trainer loads it, read from disk once per test session."""
    return load_model(model_dir)[0]


class Parts:
    """A tiny model with adapter slots, its executor, and run states created on it."""

    def __init__(self, model_dir: Path, *, max_runs: int = 3, max_rank: int = 8, budget: int = 128):
        self.model = copy.deepcopy(_base_model(model_dir))
        self.lora = MultiLoRA.attach(self.model, n_adapters=max_runs, max_rank=max_rank)
        self.pad_id = 0
        self.vocab_size = VOCAB
        self.executor = StepExecutor(
            self.model,
            self.lora,
            token_budget=budget,
            pad_id=self.pad_id,
            vocab_size=self.vocab_size,
        )
        self.states: dict[int, RunState] = {}

    def add_run(self, idx: int, run_id: str, cfg: OrchConfig, checkpoint: Any = None) -> RunState:
        state = create_run_state(self.lora, idx, run_id, cfg, cfg.digest(), checkpoint)
        self.states[idx] = state
        return state

    def step(self, batches: Mapping[int, RolloutBatch]) -> dict[int, Any]:
        """One trainer step; applies progress as the service does; returns the results."""
        report = self.executor.run(list(batches.items()), self.states)
        for slot, result in report.runs.items():
            if result.trained:
                self.states[slot].advance(result.num_tokens, result.num_samples, result.reward_mean)
        return report.runs

    def adapter(self, idx: int) -> dict[str, torch.Tensor]:
        return self.lora.slot_state_dict(idx)

    def base_logprobs(self, batch: RolloutBatch, temperature: float = 1.0) -> RolloutBatch:
        """``batch`` with each completion's log-probabilities under the base model, which is
        what a fresh adapter (B = 0) computes: an exactly on-policy batch."""
        samples = []
        for s in batch.samples:
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            with torch.no_grad(), self.lora.use([NO_ADAPTER]):
                logits = self.model(input_ids=ids).logits
            lp = selected_logprobs(logits[:, :-1], ids[:, 1:], temperature)[0]
            tail = lp[len(s.prompt_ids) - 1 :].tolist()
            samples.append(
                Sample(
                    prompt_ids=s.prompt_ids,
                    completion_ids=s.completion_ids,
                    completion_logprobs=tail,
                    reward=s.reward,
                    advantage=s.advantage,
                )
            )
        return RolloutBatch(
            run_id=batch.run_id,
            step=batch.step,
            policy_version=batch.policy_version,
            samples=samples,
        )


def same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
