"""The multi-run step: runs mixed in shared micro-batches, each updated only by its own batch."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_support import Parts, config, make_batch, num_tokens, same_tensors, with_samples


@pytest.fixture
def parts(tiny_dir):
    return Parts(tiny_dir, max_runs=3, max_rank=8, budget=96)


def test_three_runs_mixed_each_changes_only_with_its_own_step(parts):
    parts.add_run(0, "run_a", config(rank=8, alpha=16, lr=1e-2))
    parts.add_run(1, "run_b", config(rank=4, alpha=4, lr=5e-3, temperature=0.7))
    parts.add_run(2, "run_c", config(rank=2, alpha=7.5, lr=1e-2, kl_coef=0.1))
    before = {i: parts.adapter(i) for i in range(3)}
    a0, b0, c0 = (make_batch(r, 0, num_samples=6) for r in ("run_a", "run_b", "run_c"))

    results = parts.step({0: a0, 2: c0})
    assert results.keys() == {0, 2}
    for slot, batch in ((0, a0), (2, c0)):
        r = results[slot]
        assert r.trained and r.reason is None
        assert math.isfinite(r.loss) and r.grad_norm > 0
        assert (r.num_samples, r.num_tokens) == (6, num_tokens(batch))
        assert r.stats.num_tokens == sum(len(s.completion_ids) for s in batch.samples)
        assert not same_tensors(parts.adapter(slot), before[slot])
    # micro-batches of 96 tokens hold both runs' rows; run_b took no part and is untouched
    assert same_tensors(parts.adapter(1), before[1])
    assert parts.states[1].optimizer.state == {}
    assert all(p.grad is None for i in range(3) for p in parts.lora.slot_parameters(i))

    after_first = {i: parts.adapter(i) for i in range(3)}
    results = parts.step({1: b0})
    assert results[1].trained
    assert not same_tensors(parts.adapter(1), before[1])
    assert same_tensors(parts.adapter(0), after_first[0])
    assert same_tensors(parts.adapter(2), after_first[2])
    assert [s.progress.step for s in parts.states.values()] == [1, 1, 1]


def test_training_together_equals_training_apart(tiny_dir):
    """A run's update does not depend on which other runs share its micro-batches."""
    together, apart = Parts(tiny_dir, budget=64), Parts(tiny_dir, budget=64)
    for p in (together, apart):
        p.add_run(0, "run_a", config(rank=4))
        p.add_run(1, "run_b", config(rank=8, alpha=4))
    for step in range(2):
        a, b = make_batch("run_a", step, num_samples=5), make_batch("run_b", step, num_samples=3)
        results = together.step({0: a, 1: b})
        assert len({r.trained for r in results.values()}) == 1
        apart.step({0: a})
        apart.step({1: b})
    for slot in (0, 1):
        t, s = together.adapter(slot), apart.adapter(slot)
        for key in t:
            torch.testing.assert_close(t[key], s[key], atol=2e-5, rtol=1e-4)
    assert together.states[0].progress == apart.states[0].progress


def test_progress_counts_exact_tokens_and_samples(parts):
    state = parts.add_run(0, "run_a", config())
    batches = [make_batch("run_a", s, num_samples=n) for s, n in enumerate((3, 5, 2))]
    for batch in batches:
        parts.step({0: batch})
    assert state.progress.step == 3
    assert state.progress.total_samples == 10
    assert state.progress.total_tokens == sum(num_tokens(b) for b in batches)
    rewards = [s.reward for s in batches[-1].samples]
    assert state.progress.reward_mean == pytest.approx(sum(rewards) / len(rewards))


def test_on_policy_batch_at_the_run_temperature_has_ratio_one(parts):
    """Log-probabilities are taken at the run's sampling temperature: a batch sampled (scored)
    by the base model at T = 0.5 has importance ratio 1 under a fresh adapter, and no KL."""
    parts.add_run(0, "run_t", config(temperature=0.5, kl_coef=0.5))
    parts.add_run(1, "run_u", config(temperature=1.0))
    batch_t = parts.base_logprobs(make_batch("run_t", 0), temperature=0.5)
    batch_u = parts.base_logprobs(make_batch("run_u", 0), temperature=0.5)
    results = parts.step({0: batch_t, 1: batch_u})
    t, u = results[0].stats, results[1].stats
    assert t.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert t.ratio_max == pytest.approx(1.0, abs=1e-5)
    assert t.kl_mean == pytest.approx(0.0, abs=1e-6)
    # scored at 1.0, the same log-probabilities are off by a clear margin
    assert abs(u.ratio_mean - 1.0) > 0.05


def test_kl_term_grows_once_the_adapter_moves(parts):
    parts.add_run(0, "run_kl", config(kl_coef=1.0, lr=5e-2))
    first = parts.step({0: parts.base_logprobs(make_batch("run_kl", 0))})[0]
    second = parts.step({0: parts.base_logprobs(make_batch("run_kl", 1))})[0]
    assert first.stats.kl_mean == pytest.approx(0.0, abs=1e-7)
    assert second.stats.kl_mean > 1e-6


def test_non_finite_loss_of_one_run_leaves_the_others_unaffected(tiny_dir):
    """An advantage of 3e38 is finite on the wire but overflows the run's loss to inf; only that
    run is refused, and the other run's update is exactly what it is when trained alone."""
    mixed, alone = Parts(tiny_dir, budget=64), Parts(tiny_dir, budget=64)
    for p in (mixed, alone):
        p.add_run(0, "run_bad", config())
        p.add_run(1, "run_good", config())
    bad = make_batch("run_bad", 0, advantage=3e38, num_samples=5)
    good = make_batch("run_good", 0, num_samples=5)
    before_bad = mixed.adapter(0)

    results = mixed.step({0: bad, 1: good})
    assert not results[0].trained
    assert results[0].reason.startswith("non-finite loss (")
    assert "step 0" in results[0].reason
    assert same_tensors(mixed.adapter(0), before_bad)
    assert mixed.states[0].optimizer.state == {} and mixed.states[0].progress.step == 0
    assert all(p.grad is None for p in mixed.lora.slot_parameters(0))

    assert results[1].trained and math.isfinite(results[1].loss)
    alone.step({1: good})
    for key, value in alone.adapter(1).items():
        torch.testing.assert_close(mixed.adapter(1)[key], value, atol=2e-5, rtol=1e-4)


def test_non_finite_gradient_refuses_only_that_run(parts):
    parts.add_run(0, "run_bad", config())
    parts.add_run(1, "run_good", config())
    before = parts.adapter(0)
    # A finite loss whose gradient overflows: the hook stands in for a layer that blows up.
    param = parts.lora.slot_parameters(0)[1]
    handle = param.register_hook(lambda g: g * float("inf"))
    try:
        results = parts.step({0: make_batch("run_bad", 0), 1: make_batch("run_good", 0)})
    finally:
        handle.remove()
    assert not results[0].trained
    assert results[0].reason.startswith("non-finite gradient (norm ")
    assert same_tensors(parts.adapter(0), before)
    assert results[1].trained and parts.states[1].progress.step == 1


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"completion_ids": lambda s: [*s.completion_ids[:-1], 500]}, "is outside the vocabulary"),
        ({"completion_logprobs": lambda s: [*s.completion_logprobs, -1.0]}, "must have the same"),
        ({"completion_logprobs": lambda s: [float("nan")] * len(s.completion_ids)}, "not finite"),
    ],
    ids=["out-of-vocabulary", "lengths", "nan-logprobs"],
)
def test_invalid_batch_is_refused_with_the_packer_reason(parts, change, expected):
    parts.add_run(0, "run_bad", config())
    parts.add_run(1, "run_good", config())
    bad = with_samples(make_batch("run_bad", 3), **change)
    parts.states[0].progress.step = 3
    results = parts.step({0: bad, 1: make_batch("run_good", 0)})
    assert not results[0].trained
    assert results[0].reason.startswith("rejected batch: step 3 sample 0: ")
    assert expected in results[0].reason
    assert results[1].trained
