"""RL through the Tinker API from the warm-started base, as the cookbook's minimal RL example
does it: sample a group per training prompt from the newest saved weights, score with the
``reverse`` task, centre the rewards within each group, ``forward_backward`` with
``importance_sampling``, ``optim_step``.

"It learned" is judged as plexrl judges it everywhere: on held-out prompts the loop never
trains on, the trained adapter's greedy answers beat the base at its best temperature. The
sampled reward at temperature 1 is printed beside it, not asserted: it rises whenever the policy
merely sharpens, and from this base (most of whose greedy answers are the warm start's slip) it
moves by less than its own step-to-step noise in a dozen steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker
from gateway_support import Stack, rl_datum, running_stack
from rich.console import Console
from tinker import types

from services.envs import Environment, ReverseEnv, prompt_token_ids, score_completion
from services.model.loader import load_tokenizer
from services.up.app import ensure_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, PROMPTS, GROUP = 12, 8, 8
HELDOUT = 48
BASE_TEMPERATURES = (0.0, 0.5, 1.0)
BASE_SAMPLES = 4
"""Completions per held-out prompt when the base is sampled above temperature 0."""


@pytest.fixture(scope="module")
def warm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = Path(ensure_tiny_model(Console(quiet=True)))
    with running_stack(tmp_path_factory.mktemp("gateway-rl"), model, max_runs=2) as s:
        yield s


def heldout_reward(
    sampler: Any, env: Environment, tok: Any, temperature: float, samples: int
) -> float:
    """Mean reward of ``samples`` completions per held-out prompt at ``temperature``."""
    prompts = env.heldout_prompts(HELDOUT)
    futures = [
        sampler.sample(
            types.ModelInput.from_ints(prompt_token_ids(tok, p)),
            samples,
            types.SamplingParams(max_tokens=16, temperature=temperature, seed=7_000 + i),
        )
        for i, p in enumerate(prompts)
    ]
    scores = [
        score_completion(env, tok, prompt, list(s.tokens))
        for prompt, future in zip(prompts, futures, strict=True)
        for s in future.result(timeout=120).sequences
    ]
    assert len(scores) == HELDOUT * samples
    return statistics.fmean(scores)


def test_reinforce_through_the_sdk_beats_the_base_on_heldout_prompts(warm_stack: Stack) -> None:
    tok = load_tokenizer(warm_stack.model)
    env = ReverseEnv(seed=3)
    service = tinker.ServiceClient(base_url=warm_stack.url, api_key="tml-plexrl-test")
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    adam = types.AdamParams(learning_rate=3e-3)

    base = trainer.save_weights_and_get_sampling_client().result()
    base_by_t = {
        t: heldout_reward(base, env, tok, t, 1 if t == 0 else BASE_SAMPLES)
        for t in BASE_TEMPERATURES
    }

    means, heldout = [], {p.text for p in env.heldout_prompts(HELDOUT)}
    for step in range(STEPS):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompts = [env.train_prompt(step * PROMPTS + i) for i in range(PROMPTS)]
        assert not heldout & {p.text for p in prompts}
        ids = [prompt_token_ids(tok, p) for p in prompts]
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(p),
                GROUP,
                types.SamplingParams(max_tokens=16, temperature=1.0, seed=step * 1000 + i),
            )
            for i, p in enumerate(ids)
        ]
        data, rewards = [], []
        for prompt, p_ids, future in zip(prompts, ids, futures, strict=True):
            group = future.result(timeout=120).sequences
            scores = [score_completion(env, tok, prompt, list(s.tokens)) for s in group]
            rewards += scores
            mean = statistics.fmean(scores)
            data += [
                rl_datum(p_ids, seq, score - mean) for seq, score in zip(group, scores, strict=True)
            ]
        means.append(statistics.fmean(rewards))
        trainer.forward_backward(data, "importance_sampling").result(timeout=120)
        trainer.optim_step(adam).result(timeout=120)

    trained = trainer.save_weights_and_get_sampling_client().result()
    greedy = heldout_reward(trained, env, tok, 0.0, 1)
    best_t = max(base_by_t, key=base_by_t.__getitem__)
    print("sampled reward per step (T=1):", [round(m, 3) for m in means])
    print(
        "held-out: base",
        {t: round(r, 3) for t, r in base_by_t.items()},
        f"trained greedy {greedy:.3f}",
    )
    assert greedy > base_by_t[best_t] + 0.1, (greedy, base_by_t, means)
