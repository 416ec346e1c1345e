"""A short RL loop written the way the tinker-cookbook's minimal RL example is: sample a group
per prompt from the latest saved weights, score, centre the rewards within each group, train
with ``importance_sampling``, step.

Every step samples from the weights the trainer holds at that moment, so the importance ratio
is exactly 1 and the loss is exactly ``-sum(advantages)`` over the completion tokens: the
check that the sampler serves the newest version, that its log-probabilities are the trainer's,
and that the advantages reach the loss. (The untrained tiny model's reward on this task moves
too little in a few steps for a test to assert that it rises.)"""

from __future__ import annotations

import statistics

import pytest
import tinker
from gateway_support import rl_datum
from tinker import types

from schemas.config import OrchConfig
from services.model.loader import load_tokenizer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif("driver" not in OrchConfig.model_fields, reason="no training commands"),
]

PROMPTS = ("abc", "hello")
GROUP = 8


def reward(text: str) -> float:
    """The share of lowercase letters."""
    return sum(c.islower() for c in text) / len(text) if text else 0.0


def test_an_importance_sampling_loop_samples_the_trained_weights(stack) -> None:
    tok = load_tokenizer(stack.model)
    service = tinker.ServiceClient(base_url=stack.url, api_key="tml-plexrl-test")
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    adam = types.AdamParams(learning_rate=2e-2)
    means, losses = [], []
    for step in range(5):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        data, rewards = [], []
        prompts = [[tok.bos_token_id, *tok.encode(p, add_special_tokens=False)] for p in PROMPTS]
        futures = [
            sampler.sample(
                types.ModelInput.from_ints(p),
                GROUP,
                types.SamplingParams(max_tokens=6, temperature=1.0, seed=step * 100 + i),
            )
            for i, p in enumerate(prompts)
        ]
        for prompt, future in zip(prompts, futures, strict=True):
            group = future.result(timeout=120).sequences
            scores = [reward(tok.decode(s.tokens, skip_special_tokens=True)) for s in group]
            rewards += scores
            mean, spread = statistics.fmean(scores), statistics.pstdev(scores) or 1.0
            data += [
                rl_datum(prompt, seq, (score - mean) / spread)
                for seq, score in zip(group, scores, strict=True)
            ]
        means.append(statistics.fmean(rewards))
        out = trainer.forward_backward(data, "importance_sampling").result(timeout=120)
        expected = -sum(sum(d.loss_fn_inputs["advantages"].tolist()) for d in data)
        losses.append((out.metrics["loss:sum"], expected))
        trainer.optim_step(adam).result(timeout=120)
    assert len(means) == 5 and all(0.0 <= m <= 1.0 for m in means)
    for got, expected in losses:
        assert got == pytest.approx(expected, abs=1e-3), losses
    assert any(abs(expected) > 0.1 for _, expected in losses), losses  # not a trivial zero
