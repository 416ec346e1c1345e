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
from collections.abc import Iterator

import pytest
import tinker
from gateway_support import rl_datum
from tinker import types

from services.model.loader import load_tokenizer

pytestmark = pytest.mark.timeout(300)

PROMPTS = ("abc", "hello")
GROUP = 8


@pytest.fixture(scope="module")
def service(stack) -> Iterator[tinker.ServiceClient]:
    """One Tinker session for the module, ended when it is done: its runs give their slots
    back to the stack's other tests at once, not when the session expires."""
    with tinker.ServiceClient(base_url=stack.url, api_key="tml-plexrl-test") as s:
        yield s


def reward(text: str) -> float:
    """The share of lowercase letters."""
    return sum(c.islower() for c in text) / len(text) if text else 0.0


def test_an_importance_sampling_loop_samples_the_trained_weights(service, stack) -> None:
    tok = load_tokenizer(stack.model)
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


def test_a_kl_to_reference_loop_scores_samples_with_a_base_sampler(service, stack) -> None:
    """The cookbook's KL penalty: every sampled sequence is scored by a sampler of the base
    model (``compute_logprobs``), and ``kl_t = log pi(x_t) - log pi_ref(x_t)`` is taken off
    each token's advantage. At step 0 the policy is the base (a fresh adapter), so the KL is 0
    to the float rounding; once trained, the policy has moved away from the reference."""
    tok = load_tokenizer(stack.model)
    trainer = service.create_lora_training_client(base_model="tiny-base", rank=8).result()
    reference = service.create_sampling_client(base_model="tiny-base").result()
    prompt = [tok.bos_token_id, *tok.encode("abc", add_special_tokens=False)]
    kls = []
    for step in range(4):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        group = (
            sampler.sample(
                types.ModelInput.from_ints(prompt),
                4,
                types.SamplingParams(max_tokens=6, temperature=1.0, seed=step),
            )
            .result(timeout=120)
            .sequences
        )
        scores = [reward(tok.decode(s.tokens, skip_special_tokens=True)) for s in group]
        mean = statistics.fmean(scores)
        data, step_kl = [], []
        for seq, score in zip(group, scores, strict=True):
            full = types.ModelInput.from_ints(prompt + list(seq.tokens))
            ref = reference.compute_logprobs(full).result(timeout=120)[len(prompt) :]
            kl = [lp - r for lp, r in zip(seq.logprobs, ref, strict=True)]
            step_kl += kl
            datum = rl_datum(prompt, seq, score - mean)
            advantages = datum.loss_fn_inputs["advantages"].tolist()
            n = len(prompt) - 1
            advantages[n:] = [a - 0.1 * k for a, k in zip(advantages[n:], kl, strict=True)]
            data.append(
                types.Datum(
                    model_input=datum.model_input,
                    loss_fn_inputs={**datum.loss_fn_inputs, "advantages": advantages},
                )
            )
        kls.append(statistics.fmean(step_kl))
        trainer.forward_backward(data, "importance_sampling").result(timeout=120)
        trainer.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=120)
    assert kls[0] == pytest.approx(0.0, abs=1e-4), kls
    assert max(abs(k) for k in kls[1:]) > 1e-3, kls
