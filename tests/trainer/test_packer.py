"""Packing several runs' rollout batches into micro-batches."""

from __future__ import annotations

import math
import re

import pytest
import torch

from schemas.events import RolloutBatch, Sample
from services.trainer.packer import pack_step

VOCAB = 64
PAD = 0


def _sample(
    prompt_len: int, completion_len: int, *, advantage: float = 1.0, first: int = 1
) -> Sample:
    ids = [(first + i) % (VOCAB - 1) + 1 for i in range(prompt_len + completion_len)]
    return Sample(
        prompt_ids=ids[:prompt_len],
        completion_ids=ids[prompt_len:],
        completion_logprobs=[-0.1 * (i + 1) for i in range(completion_len)],
        reward=0.0,
        advantage=advantage,
    )


def _batch(run_id: str, samples: list[Sample], step: int = 0) -> RolloutBatch:
    return RolloutBatch(run_id=run_id, step=step, policy_version=step, samples=samples)


def test_hand_example_layout_and_causal_alignment() -> None:
    sample = Sample(
        prompt_ids=[5, 6, 7],
        completion_ids=[8, 9],
        completion_logprobs=[-0.5, -0.25],
        reward=1.0,
        advantage=0.75,
    )
    short = Sample(
        prompt_ids=[11], completion_ids=[12], completion_logprobs=[-2.0], reward=0, advantage=-1.0
    )
    step = pack_step(
        [(4, _batch("run_a", [sample, short]))], token_budget=100, pad_id=PAD, vocab_size=VOCAB
    )
    (mb,) = step.micro_batches
    assert torch.equal(mb.input_ids_BT, torch.tensor([[5, 6, 7, 8, 9], [11, 12, 0, 0, 0]]))
    assert torch.equal(mb.target_ids_BT, torch.tensor([[6, 7, 8, 9, 0], [12, 0, 0, 0, 0]]))
    assert torch.equal(mb.attention_mask_BT, torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]))
    # Position t predicts target t: completion token 8 is predicted at position 2 (P - 1).
    assert torch.equal(
        mb.loss_mask_BT,
        torch.tensor([[False, False, True, True, False], [True, False, False, False, False]]),
    )
    assert torch.equal(
        mb.old_logprobs_BT, torch.tensor([[0, 0, -0.5, -0.25, 0], [-2.0, 0, 0, 0, 0]])
    )
    assert torch.equal(mb.target_ids_BT[mb.loss_mask_BT], torch.tensor([8, 9, 12]))
    assert torch.equal(mb.advantages_B, torch.tensor([0.75, -1.0]))
    assert torch.equal(mb.slot_ids_B, torch.tensor([4, 4]))
    assert mb.sample_run == ["run_a", "run_a"]
    assert mb.sample_index == [0, 1]
    assert (mb.num_tokens, mb.num_real_tokens, mb.num_padding) == (10, 7, 3)
    assert step.tokens_per_run == {4: 3}
    assert step.samples_per_run == {4: 2}
    assert step.run_ids == {4: "run_a"}
    assert step.padding_fraction == pytest.approx(0.3)
    assert step.rejected == {}


def test_round_robin_serves_every_run_in_the_first_micro_batches() -> None:
    batches = [
        (0, _batch("run_a", [_sample(3, 3) for _ in range(9)])),
        (1, _batch("run_b", [_sample(3, 3) for _ in range(4)])),
        (2, _batch("run_c", [_sample(3, 3) for _ in range(2)])),
    ]
    # Budget 18 at 6 tokens a sample: three rows per micro-batch.
    step = pack_step(batches, token_budget=18, pad_id=PAD, vocab_size=VOCAB)
    runs = [mb.sample_run for mb in step.micro_batches]
    assert runs == [
        ["run_a", "run_b", "run_c"],
        ["run_a", "run_b", "run_c"],
        ["run_a", "run_b", "run_a"],
        ["run_b", "run_a", "run_a"],
        ["run_a", "run_a", "run_a"],
    ]
    assert step.samples_per_run == {0: 9, 1: 4, 2: 2}
    assert step.tokens_per_run == {0: 27, 1: 12, 2: 6}


@pytest.mark.parametrize("a_first", [True, False])
def test_a_large_batch_cannot_starve_a_small_one(a_first: bool) -> None:
    """Run A brings 64 samples, run B 4: B's samples all go into the first micro-batch, beside
    as many of A's, whichever batch came first."""
    a = (0, _batch("run_a", [_sample(4, 4 + i % 5, first=i) for i in range(64)]))
    b = (1, _batch("run_b", [_sample(4, 2 + i, first=100 + i) for i in range(4)]))
    # Budget 96 at up to 12 tokens a row: eight rows per micro-batch.
    step = pack_step([a, b] if a_first else [b, a], token_budget=96, pad_id=PAD, vocab_size=VOCAB)
    first = step.micro_batches[0]
    assert first.num_rows == 8
    assert sorted(
        i for r, i in zip(first.sample_run, first.sample_index, strict=True) if r == "run_b"
    ) == [
        0,
        1,
        2,
        3,
    ]
    assert first.sample_run.count("run_a") == 4
    # A first-come packing would have filled the first seven micro-batches with A alone.
    assert all(mb.sample_run == ["run_a"] * mb.num_rows for mb in step.micro_batches[1:])
    assert sum(mb.num_rows for mb in step.micro_batches) == 68
    assert step.samples_per_run == {0: 64, 1: 4}


def test_budget_is_respected_and_counts_are_exact() -> None:
    lengths = {"run_a": [(2, 9), (4, 1), (3, 3), (1, 1), (5, 7)], "run_b": [(6, 6), (2, 2)]}
    batches = [
        (slot, _batch(run, [_sample(p, c) for p, c in shapes]))
        for slot, (run, shapes) in enumerate(lengths.items())
    ]
    step = pack_step(batches, token_budget=24, pad_id=PAD, vocab_size=VOCAB)
    assert all(mb.num_tokens <= 24 for mb in step.micro_batches)
    assert step.tokens_per_run == {0: 9 + 1 + 3 + 1 + 7, 1: 6 + 2}
    # Every sample appears exactly once, and the loss mask counts match per run.
    seen = sorted(
        (run, i)
        for mb in step.micro_batches
        for run, i in zip(mb.sample_run, mb.sample_index, strict=True)
    )
    assert seen == [("run_a", i) for i in range(5)] + [("run_b", i) for i in range(2)]
    for slot in (0, 1):
        counted = sum(
            int(mb.loss_mask_BT[mb.slot_ids_B == slot].sum()) for mb in step.micro_batches
        )
        assert counted == step.tokens_per_run[slot]


def test_sorting_by_length_pads_less_than_arrival_order() -> None:
    # Arrival order alternates long (10) and short (2) samples. Packed as they come with
    # budget 20, every micro-batch is [10, 2] or [2, 10]: 4 micro-batches, 32 of 80 padded.
    a = _batch("run_a", [_sample(1, 1), _sample(5, 5), _sample(1, 1), _sample(5, 5)])
    b = _batch("run_b", [_sample(5, 5), _sample(1, 1), _sample(5, 5), _sample(1, 1)])
    naive_padding = 32 / 80
    step = pack_step([(0, a), (1, b)], token_budget=20, pad_id=PAD, vocab_size=VOCAB)
    # Sorted: [10, 10], [10, 10], [2, 2, 2, 2]: no padding at all, and one pass fewer.
    assert [mb.input_ids_BT.shape for mb in step.micro_batches] == [(2, 10), (2, 10), (4, 2)]
    assert step.padding_fraction == 0.0 < naive_padding
    assert all(
        mb.sample_run == ["run_a", "run_b"] * (mb.num_rows // 2) for mb in step.micro_batches
    )


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (
            Sample(
                prompt_ids=[1],
                completion_ids=[2, 3],
                completion_logprobs=[-1.0],
                reward=0,
                advantage=0,
            ),
            "step 7 sample 1: 1 completion_logprobs for 2 completion_ids",
        ),
        (
            Sample(
                prompt_ids=[1, 64],
                completion_ids=[2],
                completion_logprobs=[-1.0],
                reward=0,
                advantage=0,
            ),
            "step 7 sample 1: prompt_ids[1] = 64 is outside the vocabulary [0, 64)",
        ),
        (
            Sample(
                prompt_ids=[1],
                completion_ids=[2, 3, 99],
                completion_logprobs=[-1.0] * 3,
                reward=0,
                advantage=0,
            ),
            "step 7 sample 1: completion_ids[2] = 99 is outside the vocabulary [0, 64)",
        ),
        (
            Sample(
                prompt_ids=[1] * 20,
                completion_ids=[2] * 13,
                completion_logprobs=[-1.0] * 13,
                reward=0,
                advantage=0,
            ),
            "step 7 sample 1: 33 tokens (20 prompt + 13 completion) exceed the micro-batch token budget 32",
        ),
        (
            Sample(
                prompt_ids=[], completion_ids=[2], completion_logprobs=[-1.0], reward=0, advantage=0
            ),
            "step 7 sample 1: empty prompt_ids",
        ),
        (
            Sample(
                prompt_ids=[1],
                completion_ids=[2, 3],
                completion_logprobs=[-1.0, math.nan],
                reward=0,
                advantage=0,
            ),
            "step 7 sample 1: completion_logprobs[1] = nan is not finite",
        ),
        (
            Sample(
                prompt_ids=[1],
                completion_ids=[2],
                completion_logprobs=[-1.0],
                reward=0,
                advantage=math.inf,
            ),
            "step 7 sample 1: advantage inf is not finite",
        ),
    ],
)
def test_bad_sample_rejects_its_run_and_the_others_still_pack(bad: Sample, reason: str) -> None:
    batches = [
        (0, _batch("run_good", [_sample(2, 3), _sample(3, 2)])),
        (1, _batch("run_bad", [_sample(2, 2), bad, _sample(2, 2)], step=7)),
        (2, _batch("run_also_good", [_sample(4, 4)])),
    ]
    step = pack_step(batches, token_budget=32, pad_id=PAD, vocab_size=VOCAB)
    assert set(step.rejected) == {"run_bad"}
    # the reason and its explanation, and with one bad sample no count of them
    got = step.rejected["run_bad"]
    assert re.fullmatch(re.escape(reason) + r"( \([^()]*\))?", got) and "invalid)" not in got
    assert step.tokens_per_run == {0: 5, 2: 4}
    assert step.run_ids == {0: "run_good", 2: "run_also_good"}
    packed = {run for mb in step.micro_batches for run in mb.sample_run}
    assert packed == {"run_good", "run_also_good"}


def test_rejection_counts_every_bad_sample_and_empty_batches() -> None:
    bad = Sample(prompt_ids=[1], completion_ids=[2], completion_logprobs=[], reward=0, advantage=0)
    step = pack_step(
        [(0, _batch("run_x", [_sample(1, 1), bad, bad])), (1, _batch("run_y", [], step=3))],
        token_budget=32,
        pad_id=PAD,
        vocab_size=VOCAB,
    )
    assert step.rejected == {
        "run_x": "step 0 sample 1: 0 completion_logprobs for 1 completion_ids "
        "(they must have the same length) (2 of 3 samples invalid)",
        "run_y": "step 3: the batch has no samples",
    }
    assert step.micro_batches == [] and step.padding_fraction == 0.0


def test_a_packing_takes_at_most_one_step_per_run() -> None:
    one = _batch("run_a", [_sample(1, 1)], step=1)
    two = _batch("run_a", [_sample(1, 1)], step=2)
    with pytest.raises(ValueError, match=r"run_a appears twice in one packing \(steps 1 and 2\)"):
        pack_step([(0, one), (0, two)], token_budget=8, pad_id=PAD, vocab_size=VOCAB)
    other = _batch("run_b", [_sample(1, 1)])
    with pytest.raises(ValueError, match="slot 0 is given to both run_a and run_b"):
        pack_step([(0, one), (0, other)], token_budget=8, pad_id=PAD, vocab_size=VOCAB)


def test_edges_of_what_fits_and_the_tensor_types() -> None:
    # token 0 and the last id are in the vocabulary; a sample of exactly the budget fits
    edge = Sample(
        prompt_ids=[0, VOCAB - 1],
        completion_ids=[0],
        completion_logprobs=[-1.0],
        reward=0,
        advantage=0.5,
    )
    step = pack_step([(3, _batch("run_a", [edge]))], token_budget=3, pad_id=PAD, vocab_size=VOCAB)
    assert step.rejected == {}
    (mb,) = step.micro_batches
    assert torch.equal(mb.input_ids_BT, torch.tensor([[0, VOCAB - 1, 0]]))
    dtypes = [
        mb.input_ids_BT.dtype,
        mb.target_ids_BT.dtype,
        mb.attention_mask_BT.dtype,
        mb.loss_mask_BT.dtype,
        mb.old_logprobs_BT.dtype,
        mb.advantages_B.dtype,
        mb.slot_ids_B.dtype,
    ]
    assert dtypes == [torch.long] * 3 + [torch.bool, torch.float32, torch.float32, torch.long]
    # the id reported is the first outside the vocabulary, after a valid 0
    bad = Sample(
        prompt_ids=[0, VOCAB],
        completion_ids=[1],
        completion_logprobs=[-1.0],
        reward=0,
        advantage=0,
    )
    step = pack_step([(3, _batch("run_a", [bad]))], token_budget=8, pad_id=PAD, vocab_size=VOCAB)
    assert step.rejected == {
        "run_a": f"step 0 sample 0: prompt_ids[1] = {VOCAB} is outside the vocabulary [0, {VOCAB})"
    }
    # a budget of one token is a budget: every sample is refused, nothing is raised
    step = pack_step([(3, _batch("run_a", [edge]))], token_budget=1, pad_id=PAD, vocab_size=VOCAB)
    assert step.micro_batches == [] and list(step.rejected) == ["run_a"]


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        pack_step([], token_budget=0, pad_id=PAD, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="pad_id 64"):
        pack_step([], token_budget=8, pad_id=64, vocab_size=VOCAB)
