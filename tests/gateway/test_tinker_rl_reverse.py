"""RL through the Tinker API from the warm-started base, as the cookbook's minimal RL example
does it: sample a group per prompt from the newest saved weights, score with the ``reverse``
task, centre the rewards within each group, ``forward_backward`` with ``importance_sampling``,
``optim_step``. The sampled reward rises (the same rise ``plexrl up`` shows for the task)."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from gateway_support import Stack, rl_datum, running_stack
from rich.console import Console
from tinker import types

from services.envs import ReverseEnv, prompt_token_ids, score_completion
from services.model.loader import load_tokenizer
from services.up.app import ensure_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

STEPS, PROMPTS, GROUP = 12, 8, 8


@pytest.fixture(scope="module")
def warm_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model = Path(ensure_tiny_model(Console(quiet=True)))
    with running_stack(tmp_path_factory.mktemp("gateway-rl"), model, max_runs=2) as s:
        yield s


def test_reinforce_through_the_sdk_raises_the_reverse_reward(warm_stack: Stack) -> None:
    tok = load_tokenizer(warm_stack.model)
    env = ReverseEnv(seed=3)
    service = tinker.ServiceClient(base_url=warm_stack.url, api_key="tml-plexrl-test")
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    adam = types.AdamParams(learning_rate=3e-3)
    means = []
    for step in range(STEPS):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        prompts = [env.prompt(step * PROMPTS + i) for i in range(PROMPTS)]
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
    print("sampled reward per step:", [round(m, 3) for m in means])
    first, last = statistics.fmean(means[:3]), statistics.fmean(means[-3:])
    assert last > first + 0.1, means
