"""The paged generator: the static sampler's tokens, the trainer's log-probabilities, sequences
joining and leaving between decode steps, and the KV blocks they give back."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.model.decoder import unsupported_reason
from services.model.families import tiny_family_model
from services.model.loader import load_model
from services.model.lora import MultiLoRA
from services.model.paged_generate import PagedGenerator
from services.model.sampling import SequenceSpec, generate_batch

EOS = 2
PROMPTS = [[1, 10, 11, 12, 13], [1, 20], [1, *range(30, 47)], [1, 5, 6]]
SLOTS = [0, 1, 2, -1]

# bfloat16 keeps 8 bits of mantissa: every layer's output rounds to about 0.4% of its size, and
# the decoder and the trainer's forward round in different places. On the tiny model the gap per
# token is 0.0014 on average and 0.010 at most; the bounds leave room for other weights.
BF16_MAX, BF16_MEAN = 0.05, 0.01


def _model(tiny_dir: Path, randomize: Callable[..., None], dtype=torch.float32):
    model, _ = load_model(tiny_dir, dtype=dtype)
    lora = MultiLoRA.attach(model, n_adapters=3, max_rank=8)
    for idx, (rank, alpha) in enumerate([(8, 16.0), (4, 4.0), (2, 8.0)]):
        randomize(lora, idx, rank, alpha, seed=200 + idx, scale=0.3)
    return model, lora


@pytest.fixture(scope="module")
def model_lora(tiny_dir: Path, randomize: Callable[..., None]) -> tuple[Any, MultiLoRA]:
    return _model(tiny_dir, randomize)


def _specs(count: int, max_tokens: Callable[[int], int], **kw: Any) -> list[SequenceSpec]:
    temperatures, top_ps = [1.0, 0.7, 0.0, 1.0], [1.0, 1.0, 1.0, 0.8]
    return [
        SequenceSpec(
            PROMPTS[i % 4],
            slot=SLOTS[i % 4],
            max_tokens=max_tokens(i),
            temperature=kw.get("temperature", temperatures[i % 4]),
            top_p=kw.get("top_p", top_ps[i % 4]),
            seed=i,
        )
        for i in range(count)
    ]


def _trainer_logprobs(model: Any, lora: MultiLoRA, spec: SequenceSpec, tokens: list[int]):
    """log_softmax(logits / T) of each sampled token, from one forward of the whole sequence."""
    ids = list(spec.prompt_ids) + tokens
    with torch.inference_mode(), lora.use([spec.slot]):
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    start = len(spec.prompt_ids) - 1
    rows = torch.log_softmax(logits / spec.temperature, dim=-1)[start : start + len(tokens)]
    return rows.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_it_samples_what_the_static_sampler_samples(model_lora) -> None:
    model, lora = model_lora
    # Ten sequences through four rows: they join as others finish (different max_tokens), and
    # the rows of a shrinking batch are compacted.
    specs = _specs(10, lambda i: 5 + 3 * i)
    expected = generate_batch(model, lora, specs, eos_ids=[EOS], pad_id=0)
    gen = PagedGenerator(model, lora, eos_ids=[EOS], max_seqs=4, cache_tokens=512)
    got = gen.generate(specs)
    for want, out in zip(expected, got, strict=True):
        assert out.token_ids == want.token_ids
        assert out.finish_reason == want.finish_reason
        assert out.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert sum(len(o.token_ids) for o in got) > 100
    assert gen.cache.allocator.num_free == gen.cache.num_blocks - 1  # every block given back
    assert not gen.active


def test_logprobs_equal_the_trainers_forward_in_float32(model_lora) -> None:
    model, lora = model_lora
    specs = _specs(8, lambda i: 16, temperature=1.0, top_p=1.0)
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=8, cache_tokens=512)
    for spec, out in zip(specs, gen.generate(specs), strict=True):
        expected = _trainer_logprobs(model, lora, spec, out.token_ids)
        assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def test_logprobs_in_bfloat16_stay_within_its_rounding(tiny_dir, randomize) -> None:
    model, lora = _model(tiny_dir, randomize, dtype=torch.bfloat16)
    specs = _specs(8, lambda i: 24, temperature=1.0, top_p=1.0)
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=8, cache_tokens=512)
    gaps = torch.cat(
        [
            (_trainer_logprobs(model, lora, spec, out.token_ids) - torch.tensor(out.logprobs)).abs()
            for spec, out in zip(specs, gen.generate(specs), strict=True)
        ]
    )
    assert gaps.max() <= BF16_MAX and gaps.mean() <= BF16_MEAN
    assert gaps.max() > 0  # bfloat16 really ran: float32 agrees to 1e-6


def test_a_sequence_joining_mid_batch_gets_what_it_gets_alone(model_lora) -> None:
    model, lora = model_lora
    first, late = _specs(2, lambda i: 20, temperature=1.0, top_p=1.0)
    late = SequenceSpec(PROMPTS[2], slot=2, max_tokens=12, temperature=0.9, seed=77)
    (alone,) = generate_batch(model, lora, [late], eos_ids=[], pad_id=0)
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=4, cache_tokens=512)
    (running,) = gen.add([first])
    for _ in range(5):
        assert gen.step() == []
    (joined,) = gen.add([late])
    assert {running.row, joined.row} == {0, 1}
    done = []
    while gen.active:
        done += gen.step()
    assert done.index(joined) < done.index(running)  # it left while the other decoded on
    assert joined.output.token_ids == alone.token_ids
    assert joined.output.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert len(running.output.token_ids) == 20


def test_a_stop_token_ends_the_sequence_and_frees_its_row(model_lora) -> None:
    model, lora = model_lora
    greedy = SequenceSpec(PROMPTS[1], slot=0, max_tokens=10, temperature=0.0)
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=2, cache_tokens=256)
    (free,) = gen.generate([greedy])
    k = next(i for i in range(2, 10) if free.token_ids[i] not in free.token_ids[:i])
    gen.eos = frozenset([free.token_ids[k]])
    (seq,) = gen.add([greedy])
    while seq in gen.active:
        gen.step()
    assert seq.output.finish_reason == "stop"
    assert seq.output.token_ids == free.token_ids[: k + 1]
    assert seq.output.logprobs == [0.0] * (k + 1)
    assert gen.rows == [None, None]
    assert gen.cache.allocator.num_free == gen.cache.num_blocks - 1


def test_a_new_adapter_in_a_slot_reaches_the_decode_path(tiny_dir, randomize) -> None:
    model, lora = _model(tiny_dir, randomize)
    spec = SequenceSpec(PROMPTS[0], slot=1, max_tokens=8, temperature=0.0)
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=2, cache_tokens=256)
    (before,) = gen.generate([spec])
    # What the inference engine's adapter bank does with a new version: slot 1 gets slot 0's.
    lora.load_slot_state_dict(1, lora.slot_state_dict(0), rank=8, alpha=16.0)
    (after,) = gen.generate([spec])
    (expected,) = generate_batch(model, lora, [spec], eos_ids=[], pad_id=0)
    assert after.token_ids == expected.token_ids != before.token_ids
    (slot0,) = gen.generate([SequenceSpec(PROMPTS[0], slot=0, max_tokens=8, temperature=0.0)])
    assert after.token_ids == slot0.token_ids


def test_requests_it_can_never_hold_are_refused(model_lora) -> None:
    model, lora = model_lora
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=2, cache_tokens=64)
    with pytest.raises(ValueError, match="exceeds the 64 tokens"):
        gen.check([SequenceSpec(PROMPTS[0], slot=0, max_tokens=60)])
    with pytest.raises(ValueError, match="3 sequences in one request, at most 2"):
        gen.check([SequenceSpec(PROMPTS[0], slot=0, max_tokens=4)] * 3)
    specs = [SequenceSpec(PROMPTS[1], slot=0, max_tokens=4)] * 2
    assert gen.fits(specs) and not gen.fits(specs * 2)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_other_families_decode_as_their_trainers_forward(family, randomize) -> None:
    model = tiny_family_model(family, seed=0)
    assert unsupported_reason(model, 256) is None
    lora = MultiLoRA.attach(model, n_adapters=2, max_rank=4)
    randomize(lora, 0, 4, 8.0, seed=5, scale=0.3)
    specs = [SequenceSpec([1, 9, 8, 7], slot=s, max_tokens=8, seed=s + 3) for s in (0, -1)]
    gen = PagedGenerator(model, lora, eos_ids=[], max_seqs=2, cache_tokens=256)
    for spec, out in zip(specs, gen.generate(specs), strict=True):
        expected = _trainer_logprobs(model, lora, spec, out.token_ids)
        assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    ("family", "reason"),
    [("gpt2", "model_type"), ("phi3", "model_type"), ("mistral", "sliding window (8)")],
)
def test_families_it_does_not_run_say_why(family, reason) -> None:
    assert reason in (unsupported_reason(tiny_family_model(family, seed=0), 256) or "")
