"""Log-probabilities beside the sampled token's, in both generators: a prompt's own tokens equal
the trainer's forward (float32, 1e-4), the most likely alternatives are the distribution's
largest, top-k sampling never leaves the k most likely tokens, and ``ignore_eos`` generates
through end-of-sequence tokens."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model.loader import load_model
from services.model.lora import MultiLoRA
from services.model.paged_generate import PagedGenerator
from services.model.sampling import SequenceSpec, generate_batch

PROMPTS = [[1, 10, 11, 12, 13], [1, 20], [1, *range(30, 47)]]
SLOTS = [0, 1, -1]


@pytest.fixture(scope="module")
def model_lora(tiny_dir: Path, randomize: Callable[..., None]) -> tuple[Any, MultiLoRA]:
    model, _ = load_model(tiny_dir)
    lora = MultiLoRA.attach(model, n_adapters=2, max_rank=8)
    for idx in range(2):
        randomize(lora, idx, 8, 16.0, seed=300 + idx, scale=0.3)
    return model, lora


def _generators(model: Any, lora: MultiLoRA) -> dict[str, Callable[[list[SequenceSpec]], Any]]:
    paged = PagedGenerator(model, lora, eos_ids=[2], max_seqs=4, cache_tokens=512)
    return {
        "paged": paged.generate,
        "static": lambda specs: generate_batch(model, lora, specs, eos_ids=[2], pad_id=0),
    }


def _forward_logprobs(model: Any, lora: MultiLoRA, ids: list[int], slot: int) -> torch.Tensor:
    """log_softmax of every position of one forward (the trainer's), [T, V]."""
    with torch.inference_mode(), lora.use([slot]):
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("which", ["paged", "static"])
def test_prompt_logprobs_and_alternatives_equal_the_trainers_forward(model_lora, which) -> None:
    model, lora = model_lora
    specs = [
        SequenceSpec(p, slot=s, max_tokens=4, seed=i, score_prompt=True, top_logprobs=3)
        for i, (p, s) in enumerate(zip(PROMPTS, SLOTS, strict=True))
    ]
    outputs = _generators(model, lora)[which](specs)
    for spec, out in zip(specs, outputs, strict=True):
        prompt = list(spec.prompt_ids)
        lp = _forward_logprobs(model, lora, prompt, spec.slot)
        expected = [float(lp[t - 1, prompt[t]]) for t in range(1, len(prompt))]
        assert out.prompt_logprobs[0] is None
        assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4)
        assert out.prompt_top_logprobs[0] == []
        for t in range(1, len(prompt)):
            values, ids = lp[t - 1].topk(3)
            got = out.prompt_top_logprobs[t]
            assert [i for i, _ in got] == ids.tolist()
            assert [v for _, v in got] == pytest.approx(values.tolist(), abs=1e-4)
        # each sampled token's alternatives: sorted, three of them, the token's own among them
        # when it is one of the three most likely (temperature 1: the forward's distribution)
        full = _forward_logprobs(model, lora, prompt + out.token_ids, spec.slot)
        assert len(out.top_logprobs) == len(out.token_ids)
        for k, (token, top) in enumerate(zip(out.token_ids, out.top_logprobs, strict=True)):
            row = full[len(prompt) - 1 + k]
            assert [i for i, _ in top] == row.topk(3).indices.tolist()
            if token in [i for i, _ in top]:
                assert dict(top)[token] == pytest.approx(out.logprobs[k], abs=1e-5)


@pytest.mark.parametrize("which", ["paged", "static"])
def test_top_k_samples_only_among_the_k_most_likely(model_lora, which) -> None:
    model, lora = model_lora
    prompt, slot = PROMPTS[0], 0
    specs = [
        SequenceSpec(prompt, slot=slot, max_tokens=12, temperature=2.0, seed=i, top_k=2)
        for i in range(6)
    ]
    outputs = _generators(model, lora)[which](specs)
    for out in outputs:
        full = _forward_logprobs(model, lora, prompt + out.token_ids, slot)
        for k, token in enumerate(out.token_ids):
            row = full[len(prompt) - 1 + k]
            assert token in row.topk(2).indices.tolist()
            # log q is the renormalised two-token distribution at temperature 2
            pair = torch.log_softmax(row.topk(2).values / 2.0, dim=-1)
            assert out.logprobs[k] == pytest.approx(
                float(pair[row.topk(2).indices.tolist().index(token)]), abs=1e-4
            )
    # at temperature 2 without the filter, some token falls outside the two most likely
    free = [
        SequenceSpec(prompt, slot=slot, max_tokens=12, temperature=2.0, seed=i) for i in range(6)
    ]
    wide = 0
    for out in _generators(model, lora)[which](free):
        full = _forward_logprobs(model, lora, prompt + out.token_ids, slot)
        rows = full[len(prompt) - 1 : len(prompt) - 1 + len(out.token_ids)]
        wide += sum(
            t not in r.topk(2).indices.tolist() for t, r in zip(out.token_ids, rows, strict=True)
        )
    assert wide > 0


@pytest.mark.parametrize("which", ["paged", "static"])
def test_ignore_eos_generates_to_max_tokens(model_lora, which) -> None:
    model, lora = model_lora
    eos = 2
    # greedy on a prompt whose next token we force to be eos by making eos the argmax
    outputs = _generators(model, lora)[which](
        [
            SequenceSpec(PROMPTS[1], slot=-1, max_tokens=30, temperature=3.0, seed=s)
            for s in range(12)
        ]
    )
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert stopped, "no sample reached end-of-sequence; pick another prompt"
    seeds = [s for s, o in enumerate(outputs) if o.finish_reason == "stop"]
    again = _generators(model, lora)[which](
        [
            SequenceSpec(
                PROMPTS[1], slot=-1, max_tokens=30, temperature=3.0, seed=s, ignore_eos=True
            )
            for s in seeds
        ]
    )
    for before, after in zip(stopped, again, strict=True):
        assert after.finish_reason == "length" and len(after.token_ids) == 30
        assert after.token_ids[: len(before.token_ids)] == before.token_ids
        assert eos in after.token_ids


def test_lora_on_the_unembedding_reaches_every_path(tiny_dir: Path, randomize) -> None:
    """With lm_head among the targets (Tinker's train_unembed), the paged decoder's prefill,
    decode and prompt scores and the static sampler all apply its adapter as the trainer's
    forward does."""
    from services.model.lora import DEFAULT_TARGET_MODULES

    model, _ = load_model(tiny_dir)
    lora = MultiLoRA.attach(model, 2, 8, [*DEFAULT_TARGET_MODULES, "lm_head"])
    assert "lm_head" in lora.layers
    randomize(lora, 0, 8, 16.0, seed=7, scale=0.5)
    with torch.no_grad():  # only the unembedding's adapter differs from slot 1's
        for name, layer in lora.layers.items():
            if name != "lm_head":
                layer.lora_B[0].zero_()
    prompt = PROMPTS[0]
    plain = _forward_logprobs(model, lora, prompt, -1)
    adapted = _forward_logprobs(model, lora, prompt, 0)
    assert (plain - adapted).abs().max() > 0.05  # the unembedding's adapter changes the output
    specs = [SequenceSpec(prompt, slot=0, max_tokens=6, seed=3, score_prompt=True)]
    for which, generate in _generators(model, lora).items():
        [out] = generate(specs)
        full = _forward_logprobs(model, lora, prompt + out.token_ids, 0)
        expected = [float(full[t - 1, (prompt + out.token_ids)[t]]) for t in range(1, len(prompt))]
        assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-4), which
        sampled = [float(full[len(prompt) - 1 + k, t]) for k, t in enumerate(out.token_ids)]
        assert out.logprobs == pytest.approx(sampled, abs=1e-4), which
