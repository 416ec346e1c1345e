"""The shared sampler: log-probabilities, mixed-run batches, finish reasons, seeds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model.loader import load_model
from services.model.lora import MultiLoRA
from services.model.sampling import (
    SequenceSpec,
    generate_batch,
    nucleus_logprobs,
    sample_rows,
    sequence_seed,
)

EOS, PAD = 2, 0
PROMPTS = [[1, 10, 11, 12, 13, 14, 15], [1, 20], [1, 30, 31, 32], [1, 40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def model_lora(tiny_dir: Path, randomize: Callable[..., None]) -> tuple[Any, MultiLoRA]:
    """The tiny model with four slots, three of them holding random adapters of various ranks."""
    model, _ = load_model(tiny_dir)
    lora = MultiLoRA.attach(model, n_adapters=4, max_rank=8)
    for idx, (rank, alpha) in enumerate([(8, 16.0), (4, 4.0), (2, 8.0)]):
        randomize(lora, idx, rank, alpha, seed=100 + idx, scale=0.3)
    return model, lora


def _generate(model_lora: tuple[Any, MultiLoRA], specs: list[SequenceSpec], eos=(EOS,)) -> list:
    model, lora = model_lora
    return generate_batch(model, lora, specs, eos_ids=eos, pad_id=PAD)


def _specs(temperature: float, max_tokens: int = 12, seed0: int = 7) -> list[SequenceSpec]:
    slots = [0, 1, 2, -1]
    return [
        SequenceSpec(p, slot=s, max_tokens=max_tokens, temperature=temperature, seed=seed0 + i)
        for i, (p, s) in enumerate(zip(PROMPTS, slots, strict=True))
    ]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_fresh_forward_without_cache(model_lora, temperature: float) -> None:
    model, lora = model_lora
    specs = _specs(temperature, max_tokens=10)
    outputs = _generate(model_lora, specs)
    assert any(len(o.token_ids) > 3 for o in outputs)
    for spec, out in zip(specs, outputs, strict=True):
        ids = list(spec.prompt_ids) + out.token_ids
        with torch.inference_mode(), lora.use([spec.slot]):
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        # The trainer's formula: log_softmax(logits / temperature) at the previous position.
        expected = torch.log_softmax(logits / temperature, dim=-1)
        start = len(spec.prompt_ids) - 1
        picked = expected[start : start + len(out.token_ids)].gather(
            1, torch.tensor(out.token_ids).unsqueeze(1)
        )
        assert out.logprobs == pytest.approx(picked.squeeze(1).tolist(), abs=1e-4)
        assert all(lp < 0 for lp in out.logprobs)


def test_top_p_logprobs_are_the_renormalised_nucleus(model_lora) -> None:
    model, lora = model_lora
    spec = SequenceSpec(PROMPTS[0], slot=1, max_tokens=10, temperature=0.8, top_p=0.6, seed=5)
    (out,) = _generate(model_lora, [spec], eos=())
    ids = list(spec.prompt_ids) + out.token_ids
    with torch.inference_mode(), lora.use([spec.slot]):
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    start = len(spec.prompt_ids) - 1
    rows = logits[start : start + len(out.token_ids)]
    count = rows.shape[0]
    nucleus = nucleus_logprobs(rows, torch.full((count,), 0.8), torch.full((count,), 0.6))
    picked = nucleus.gather(1, torch.tensor(out.token_ids).unsqueeze(1)).squeeze(1)
    assert out.logprobs == pytest.approx(picked.tolist(), abs=1e-4)
    assert torch.isfinite(picked).all()  # every sampled token lies inside its nucleus
    full = torch.log_softmax(rows / 0.8, dim=-1).gather(1, torch.tensor(out.token_ids)[:, None])
    assert (picked >= full.squeeze(1) - 1e-6).all()  # renormalising only raises them


def test_adapters_change_the_completions(model_lora) -> None:
    # Greedy decoding of one prompt under each slot: random adapters must make a difference,
    # or the tests above would pass with adapters ignored.
    specs = [SequenceSpec(PROMPTS[0], slot=s, max_tokens=8, temperature=0.0) for s in (-1, 0, 1)]
    tokens = [tuple(o.token_ids) for o in _generate(model_lora, specs, eos=())]
    assert len(set(tokens)) == 3


def test_a_mixed_batch_equals_each_sequence_generated_alone(model_lora) -> None:
    specs = _specs(1.0, max_tokens=12)
    # Different limits make rows leave the batch at different steps.
    specs = [
        SequenceSpec(s.prompt_ids, s.slot, max_tokens=4 + 3 * i, temperature=1.0, seed=s.seed)
        for i, s in enumerate(specs)
    ]
    together = _generate(model_lora, specs)
    for spec, joint in zip(specs, together, strict=True):
        (alone,) = _generate(model_lora, [spec])
        assert joint.token_ids == alone.token_ids
        assert joint.finish_reason == alone.finish_reason
        assert joint.logprobs == pytest.approx(alone.logprobs, abs=1e-5)


def test_seeds_reproduce_and_differ(model_lora) -> None:
    spec = SequenceSpec(PROMPTS[2], slot=1, max_tokens=16, temperature=1.0, seed=123)
    first = _generate(model_lora, [spec], eos=())
    again = _generate(model_lora, [spec, spec], eos=())
    assert first[0].token_ids == again[0].token_ids == again[1].token_ids
    others = _generate(
        model_lora,
        [SequenceSpec(PROMPTS[2], 1, 16, 1.0, seed=s) for s in range(124, 128)],
        eos=(),
    )
    assert all(o.token_ids != first[0].token_ids for o in others)


def test_stop_on_eos_includes_the_token_and_length_otherwise(model_lora) -> None:
    greedy = SequenceSpec(PROMPTS[1], slot=0, max_tokens=10, temperature=0.0)
    (free,) = _generate(model_lora, [greedy], eos=())
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    assert free.logprobs == [0.0] * 10  # greedy: a point mass on the argmax
    # Declare the token greedy decoding emits at some position k as the end-of-sequence token.
    k = next(i for i in range(2, 10) if free.token_ids[i] not in free.token_ids[:i])
    (stopped,) = _generate(model_lora, [greedy], eos=(free.token_ids[k],))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: k + 1]
    short = SequenceSpec(PROMPTS[1], slot=0, max_tokens=3, temperature=0.0)
    (cut,) = _generate(model_lora, [short], eos=(free.token_ids[k],))
    assert (cut.token_ids, cut.finish_reason) == (free.token_ids[:3], "length")


def test_nucleus_keeps_the_top_mass_and_renormalises() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    out = nucleus_logprobs(logits, torch.tensor([1.0]), torch.tensor([0.8])).exp()
    # 0.5 + 0.3 reaches 0.8: the nucleus is {1, 3}, renormalised.
    assert out[0].tolist() == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)
    wide = nucleus_logprobs(logits, torch.tensor([1.0]), torch.tensor([0.81])).exp()
    assert wide[0].tolist() == pytest.approx([0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], abs=1e-6)


def test_sampling_frequencies_follow_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().expand(4000, 3)
    gens = [torch.Generator().manual_seed(sequence_seed(5, i, 0)) for i in range(4000)]
    tokens, logprobs = sample_rows(logits, [1.0] * 4000, [1.0] * 4000, gens)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert freq.tolist() == pytest.approx(probs.tolist(), abs=0.03)
    assert logprobs.tolist() == pytest.approx(probs.log()[tokens].tolist(), abs=1e-6)
    hot = sample_rows(logits[:1] * 0 + torch.tensor([0.0, 5.0, 1.0]), [0.0], [1.0], [None])
    assert hot[0].item() == 1 and hot[1].item() == 0.0


def test_sequence_seeds_are_distinct_and_stable() -> None:
    seeds = {sequence_seed(s, i, j) for s in (0, 1, -1) for i in range(5) for j in range(5)}
    assert len(seeds) == 75
    assert all(0 <= s < 2**63 for s in seeds)
    assert sequence_seed(42, 1, 2) == sequence_seed(42, 1, 2)


def test_empty_prompt_is_refused(model_lora) -> None:
    with pytest.raises(ValueError, match="at least one token"):
        _generate(model_lora, [SequenceSpec([], slot=0, max_tokens=2)])


def test_sampling_speaks_the_models_cache_keyword_and_warns_nothing(
    model_lora: tuple[Any, MultiLoRA], capfd: pytest.CaptureFixture[str]
) -> None:
    """``plexrl up``'s warm start samples with this: a deprecated keyword would print a warning
    above the user's table on every fresh machine."""
    import warnings

    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        outputs = _generate(model_lora, [SequenceSpec(PROMPTS[0], slot=0, max_tokens=4, seed=1)])
    assert len(outputs[0].token_ids) >= 1
    printed = capfd.readouterr()
    assert "deprecated" not in printed.out + printed.err
