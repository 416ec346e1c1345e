"""The policy loss on hand-computed numbers: values and gradients of every branch."""

from __future__ import annotations

import math

import pytest
import torch

from schemas.config import LossConfig
from services.trainer.loss import (
    LossParams,
    RunLossStats,
    per_run_loss,
    run_stats,
    selected_logprobs,
    token_loss,
)

CLIP = LossParams(mode="clip", clip_low=0.2, clip_high=0.2)
MASK = LossParams(mode="mask", clip_low=0.2, clip_high=0.2)


def _one_token(ratio: float, advantage: float, params: LossParams) -> tuple[float, float, bool]:
    """Loss, d loss / d logp and the clipped flag for a single token with the given ratio."""
    old = math.log(0.5)
    logp = torch.tensor([[old + math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    loss_BT, stats = token_loss(
        logp,
        torch.tensor([[old]], dtype=torch.float64),
        torch.tensor([advantage]),
        torch.ones(1, 1, dtype=torch.bool),
        params,
    )
    loss_BT.sum().backward()
    assert logp.grad is not None
    return loss_BT.item(), logp.grad.item(), bool(stats.clipped_BT.item())


def test_ratio_one_is_the_plain_policy_gradient() -> None:
    # -r*A with r = 1; d/dlogp (-A * exp(logp - old)) = -A * r.
    for params in (CLIP, MASK):
        loss, grad, clipped = _one_token(1.0, 2.0, params)
        assert loss == pytest.approx(-2.0, abs=1e-6)
        assert grad == pytest.approx(-2.0, abs=1e-6)
        assert not clipped


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "clipped"),
    [
        # A > 0, r above 1 + eps: the clipped branch (1.2 * A) wins, no gradient.
        (1.5, 1.0, -1.2, 0.0, True),
        # A > 0, r below 1 - eps: min picks r * A itself, gradient -A * r pulls r back up.
        (0.5, 1.0, -0.5, -0.5, False),
        # A < 0, r below 1 - eps: min(-0.5, -0.8) = -0.8 is the clipped branch, no gradient.
        (0.5, -1.0, 0.8, 0.0, True),
        # A < 0, r above 1 + eps: min(-1.5, -1.2) = -1.5 is r * A, gradient -A * r = 1.5.
        (1.5, -1.0, 1.5, 1.5, False),
        # Inside the trust region nothing is clipped.
        (1.1, 3.0, -3.3, -3.3, False),
    ],
)
def test_clip_mode_branches(
    ratio: float, adv: float, loss: float, grad: float, clipped: bool
) -> None:
    got_loss, got_grad, got_clipped = _one_token(ratio, adv, CLIP)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)
    assert got_clipped is clipped


@pytest.mark.parametrize(
    ("ratio", "adv", "loss", "grad", "masked"),
    [
        (1.1, 2.0, -2.2, -2.2, False),
        (0.9, -2.0, 1.8, 1.8, False),
        # Out of bounds on either side, whatever the sign of A: dropped entirely.
        (1.5, 1.0, 0.0, 0.0, True),
        (1.5, -1.0, 0.0, 0.0, True),
        (0.7, 1.0, 0.0, 0.0, True),
        (0.7, -1.0, 0.0, 0.0, True),
    ],
)
def test_mask_mode_drops_tokens_outside_the_bounds(
    ratio: float, adv: float, loss: float, grad: float, masked: bool
) -> None:
    got_loss, got_grad, got_masked = _one_token(ratio, adv, MASK)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)
    assert got_masked is masked


@pytest.mark.parametrize(
    ("ratio", "adv", "params", "loss", "grad", "clipped"),
    [
        # A < 0, r = 4 > c = 3: PPO's min(4 * -1, 1.2 * -1) = -4; max(-4, 3 * -1) = -3, so the
        # loss is 3 = c * |A| and constant: no gradient.
        (4.0, -1.0, CLIP, 3.0, 0.0, True),
        # Without the dual clip the same token has loss 4 and gradient -A * r = 4.
        (4.0, -1.0, LossParams(dual_clip=None), 4.0, 4.0, False),
        # A < 0, r = 2.5 < c: min(-2.5, -1.2) = -2.5 > -3 = c * A, PPO as before: loss 2.5,
        # gradient 2.5.
        (2.5, -1.0, CLIP, 2.5, 2.5, False),
        # The bound scales with |A|: A = -0.5, r = 10, c = 2: loss c * |A| = 1.
        (10.0, -0.5, LossParams(dual_clip=2.0), 1.0, 0.0, True),
        # A > 0 is untouched: r = 4 takes PPO's clipped branch, loss -1.2 * 1, no gradient.
        (4.0, 1.0, CLIP, -1.2, 0.0, True),
        # A < 0, r = 0.5 < 1 - 0.2: PPO's min(0.5 * -2, 0.8 * -2) = -1.6 (its own clip); the
        # max with c * A = -6 keeps -1.6: loss 1.6, no gradient.
        (0.5, -2.0, CLIP, 1.6, 0.0, True),
        # c below the upper bound (clip_high = 4, so 1 + clip_high = 5 > c = 3): r = 3.5 is
        # inside PPO's region (objective -3.5) and the dual clip still binds at -3: loss 3.
        (3.5, -1.0, LossParams(clip_high=4.0, dual_clip=3.0), 3.0, 0.0, True),
        # mask mode ignores the dual clip: with 1 + clip_high = 10 the token at r = 5 is kept,
        # loss -r * A = 5, gradient 5.
        (5.0, -1.0, LossParams(mode="mask", clip_high=9.0, dual_clip=3.0), 5.0, 5.0, False),
    ],
)
def test_dual_clip_bounds_the_loss_of_negative_advantages(
    ratio: float, adv: float, params: LossParams, loss: float, grad: float, clipped: bool
) -> None:
    got_loss, got_grad, got_clipped = _one_token(ratio, adv, params)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)
    assert got_clipped is clipped


def test_mask_mode_is_two_sided_whatever_the_sign_of_the_advantage() -> None:
    # The two cases where clip and mask differ: clip keeps A > 0 with r < 1 - eps and A < 0
    # with r > 1 + eps (their gradient -A * r pulls r back towards 1); mask drops both.
    for ratio, adv in ((0.5, 1.0), (1.5, -1.0)):
        clip_loss, clip_grad, clip_clipped = _one_token(ratio, adv, CLIP)
        assert clip_loss == pytest.approx(-ratio * adv) and clip_grad == pytest.approx(-ratio * adv)
        assert not clip_clipped
        assert _one_token(ratio, adv, MASK) == (0.0, 0.0, True)
    # And the two cases where they agree on "no gradient": clip keeps a constant, mask a zero.
    for ratio, adv, clip_value in ((1.5, 1.0, -1.2), (0.5, -1.0, 0.8)):
        clip_loss, clip_grad, clip_clipped = _one_token(ratio, adv, CLIP)
        assert clip_loss == pytest.approx(clip_value) and clip_grad == 0.0 and clip_clipped
        assert _one_token(ratio, adv, MASK) == (0.0, 0.0, True)


def test_asymmetric_bounds() -> None:
    params = LossParams(mode="mask", clip_low=0.1, clip_high=1.0)
    assert _one_token(1.9, 1.0, params)[2] is False
    assert _one_token(0.85, 1.0, params)[2] is True


@pytest.mark.parametrize(
    ("estimator", "kl", "kl_grad"),
    [
        # logp = log 0.5, ref = log 0.25: k1 = log 2. As a reward penalty at r = 1 and A = 0 the
        # token's advantage is -0.1 * log 2, its loss -r * A = 0.1 * log 2 and d/dlogp = -A * r
        # = 0.1 * log 2: k1 times the score, not the constant 0.1 of k1 used as a loss.
        ("k1", math.log(2.0), math.log(2.0)),
        # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + log 2 - 1; d/dlogp = 1 - 0.5.
        ("k3", 0.5 + math.log(2.0) - 1.0, 0.5),
    ],
)
def test_kl_estimators(estimator: str, kl: float, kl_grad: float) -> None:
    params = LossParams(mode="clip", kl_coef=0.1, kl_estimator=estimator)  # type: ignore[arg-type]
    logp = torch.tensor([[math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    loss_BT, stats = token_loss(
        logp,
        torch.tensor([[math.log(0.5)]], dtype=torch.float64),
        torch.tensor([0.0]),  # no policy term: only the KL is left
        torch.ones(1, 1, dtype=torch.bool),
        params,
        ref_logprobs_BT=torch.tensor([[math.log(0.25)]], dtype=torch.float64),
    )
    loss_BT.sum().backward()
    assert logp.grad is not None
    assert stats.kl_BT.item() == pytest.approx(kl, abs=1e-6)
    assert loss_BT.item() == pytest.approx(0.1 * kl, abs=1e-6)
    assert logp.grad.item() == pytest.approx(0.1 * kl_grad, abs=1e-6)


def test_k3_is_zero_at_the_reference_and_positive_elsewhere() -> None:
    logp_BT = torch.tensor([[-1.0, -1.0, -3.0]])
    ref_BT = torch.tensor([[-1.0, -2.0, -1.0]])
    params = LossParams(kl_coef=1.0, kl_estimator="k3")
    _, stats = token_loss(
        logp_BT, logp_BT, torch.zeros(1), torch.ones(1, 3, dtype=torch.bool), params, ref_BT
    )
    expected = [0.0, math.exp(-1) + 1 - 1, math.exp(2) - 2 - 1]
    assert torch.allclose(stats.kl_BT, torch.tensor([expected]), atol=1e-6)


def test_kl_is_added_to_the_policy_term_but_not_to_masked_tokens() -> None:
    # k1 = log 2 on both tokens. Token 0 (r = 1): A_t = 1 - 0.5 log 2, loss -A_t = -1 + 0.5 log 2
    # (the value k1 as a loss term gave too). Token 1 (r = 1.8) is masked, penalty included.
    params = LossParams(mode="mask", clip_low=0.2, clip_high=0.2, kl_coef=0.5, kl_estimator="k1")
    old_BT = torch.log(torch.tensor([[0.5, 0.5]]))
    logp_BT = torch.log(torch.tensor([[0.5, 0.9]]))  # ratios 1.0 and 1.8
    ref_BT = torch.log(torch.tensor([[0.25, 0.25]]))
    loss_BT, _ = token_loss(
        logp_BT, old_BT, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), params, ref_BT
    )
    assert torch.allclose(loss_BT, torch.tensor([[-1.0 + 0.5 * math.log(2.0), 0.0]]), atol=1e-6)


def test_padding_contributes_nothing_even_when_it_holds_garbage() -> None:
    mask_BT = torch.tensor([[True, True, False, False]])
    logp_BT = torch.tensor([[-1.0, -2.0, 500.0, float("nan")]], requires_grad=True)
    old_BT = torch.tensor([[-1.0, -2.0, -500.0, 0.0]])
    ref_BT = torch.tensor([[-1.0, -2.0, -900.0, float("nan")]])
    # At ref == logp both estimators are 0 and so are their gradients (k1's penalty is k1 * r
    # * grad logp): only the policy term's -A * r / 2 tokens = -0.5 is left.
    for estimator, grad in (("k1", -0.5), ("k3", -0.5)):
        params = LossParams(kl_coef=1.0, kl_estimator=estimator)  # type: ignore[arg-type]
        loss_BT, stats = token_loss(logp_BT, old_BT, torch.tensor([1.0]), mask_BT, params, ref_BT)
        total, _ = per_run_loss(loss_BT, mask_BT, torch.tensor([0]), {0: 2})
        logp_BT.grad = None
        total.backward()
        assert logp_BT.grad is not None
        assert torch.equal(loss_BT[0, 2:], torch.zeros(2))
        assert total.item() == pytest.approx(-1.0, abs=1e-6)  # mean of -r*A over the 2 tokens
        assert torch.equal(logp_BT.grad[0, 2:], torch.zeros(2))
        assert torch.allclose(logp_BT.grad[0, :2], torch.tensor([grad, grad]))
        assert not stats.clipped_BT[0, 2:].any()


def test_absurd_sampling_logprob_does_not_poison_the_gradient() -> None:
    # A corrupt old log-prob of -1e4 would make exp overflow; the clamp keeps it finite.
    logp_BT = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old_BT = torch.tensor([[-1e4, -1.0]])
    no_dual = LossParams(dual_clip=None)
    for params, loss0 in ((no_dual, math.exp(20.0)), (CLIP, 3.0)):
        logp_BT.grad = None
        loss_BT, stats = token_loss(
            logp_BT, old_BT, torch.tensor([-1.0]), torch.ones(1, 2, dtype=torch.bool), params
        )
        loss_BT.sum().backward()
        assert logp_BT.grad is not None
        assert torch.isfinite(loss_BT).all() and torch.isfinite(logp_BT.grad).all()
        assert stats.ratio_BT[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-5)
        # A = -1, r = e^20: PPO alone leaves the loss at e^20 * |A|; the dual clip (c = 3)
        # holds it at 3 * |A|. Either way the clamped log-ratio passes no gradient.
        assert loss_BT[0, 0].item() == pytest.approx(loss0, rel=1e-5)
        assert logp_BT.grad[0, 0].item() == 0.0
        assert logp_BT.grad[0, 1].item() == pytest.approx(1.0)


def _random_step(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows, seq = 6, 7
    mask_BT = torch.rand(rows, seq, generator=g) > 0.3
    old_BT = -torch.rand(rows, seq, generator=g) * 3
    return {
        "logp": (old_BT + 0.3 * torch.randn(rows, seq, generator=g)).double(),
        "old": old_BT.double(),
        "adv": torch.randn(rows, generator=g).double(),
        "mask": mask_BT,
        "ref": (old_BT + 0.3 * torch.randn(rows, seq, generator=g)).double(),
        "runs": torch.tensor([3, 0, 3, 3, 0, 3]),
    }


@pytest.mark.parametrize("params", [CLIP, MASK, LossParams(kl_coef=0.2, kl_estimator="k3")])
def test_micro_batch_split_gives_the_same_loss_and_gradient_as_one_batch(
    params: LossParams,
) -> None:
    d = _random_step(0)
    counts = {slot: int(d["mask"][d["runs"] == slot].sum()) for slot in (0, 3)}

    def run(rows: list[slice]) -> tuple[dict[int, float], torch.Tensor]:
        logp = d["logp"].clone().requires_grad_(True)
        per_run_sum: dict[int, float] = {}
        for sl in rows:
            loss_BT, _ = token_loss(
                logp[sl], d["old"][sl], d["adv"][sl], d["mask"][sl], params, d["ref"][sl]
            )
            total, per_run = per_run_loss(loss_BT, d["mask"][sl], d["runs"][sl], counts)
            total.backward()
            for slot, value in per_run.items():
                per_run_sum[slot] = per_run_sum.get(slot, 0.0) + value.item()
        assert logp.grad is not None
        return per_run_sum, logp.grad

    whole, grad_whole = run([slice(0, 6)])
    split, grad_split = run([slice(0, 2), slice(2, 5), slice(5, 6)])
    assert whole == pytest.approx(split, abs=1e-12)
    assert torch.allclose(grad_whole, grad_split, atol=1e-12)

    # And each run's loss is the mean of its token losses.
    loss_BT, _ = token_loss(d["logp"], d["old"], d["adv"], d["mask"], params, d["ref"])
    for slot in (0, 3):
        tokens = d["mask"] & (d["runs"] == slot).unsqueeze(-1)
        assert whole[slot] == pytest.approx(loss_BT[tokens].mean().item(), abs=1e-12)


def test_each_run_is_normalised_by_its_own_token_count() -> None:
    # Run 0: one row of 4 tokens with loss -1 each; run 1: one row of 1 token with loss -1.
    logp_BT = torch.zeros(2, 4, requires_grad=True)
    mask_BT = torch.tensor([[True] * 4, [True, False, False, False]])
    loss_BT, _ = token_loss(logp_BT, torch.zeros(2, 4), torch.ones(2), mask_BT, CLIP)
    total, per_run = per_run_loss(loss_BT, mask_BT, torch.tensor([0, 1]), torch.tensor([4, 1]))
    total.backward()
    assert logp_BT.grad is not None
    assert per_run[0].item() == pytest.approx(-1.0)
    assert per_run[1].item() == pytest.approx(-1.0)
    assert total.item() == pytest.approx(-2.0)
    assert torch.allclose(logp_BT.grad[0], torch.full((4,), -0.25))
    assert torch.allclose(logp_BT.grad[1], torch.tensor([-1.0, 0.0, 0.0, 0.0]))


def test_run_stats_count_clipped_tokens_ratios_and_kl_per_run() -> None:
    old_BT = torch.log(torch.full((2, 3), 0.5))
    # Row 0 (run 5): ratios 1.0, 1.5 (clipped, A > 0), pad. Row 1 (run 2): ratios 0.5, 1.0, 1.0.
    logp_BT = torch.log(torch.tensor([[0.5, 0.75, 0.5], [0.25, 0.5, 0.5]]))
    mask_BT = torch.tensor([[True, True, False], [True, True, True]])
    ref_BT = logp_BT - torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]])
    params = LossParams(kl_coef=0.1, kl_estimator="k1")
    _, stats = token_loss(logp_BT, old_BT, torch.tensor([1.0, -1.0]), mask_BT, params, ref_BT)
    by_run = run_stats(stats, mask_BT, torch.tensor([5, 2]))
    assert set(by_run) == {2, 5}
    assert by_run[5].num_tokens == 2 and by_run[5].num_clipped == 1
    assert by_run[5].ratio_mean == pytest.approx(1.25)
    assert by_run[5].ratio_max == pytest.approx(1.5)
    assert by_run[5].kl_mean == pytest.approx(0.5)
    # A < 0 and r = 0.5 < 0.8: clipped.
    assert by_run[2].num_tokens == 3 and by_run[2].clipped_fraction == pytest.approx(1 / 3)
    assert by_run[2].ratio_mean == pytest.approx(2.5 / 3)
    assert by_run[2].kl_mean == pytest.approx(0.5 / 3)
    assert RunLossStats().clipped_fraction == 0.0


def test_selected_logprobs_matches_log_softmax_and_its_gradient() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    for temperature in (1.0, 0.7):
        a = logits.clone().requires_grad_(True)
        b = logits.clone().requires_grad_(True)
        got = selected_logprobs(a, targets, temperature)
        want = torch.log_softmax(b / temperature, -1).gather(-1, targets[..., None])[..., 0]
        assert torch.allclose(got, want, atol=1e-12)
        got.sum().backward()
        want.sum().backward()
        assert a.grad is not None and b.grad is not None
        assert torch.allclose(a.grad, b.grad, atol=1e-12)
    # bf16 logits are upcast, so the log-probs are not rounded to bf16.
    assert selected_logprobs(logits.bfloat16(), targets).dtype == torch.float32
    # Hand case: uniform logits over 4 tokens give log(1/4) for any target.
    assert torch.allclose(
        selected_logprobs(torch.zeros(1, 2, 4), torch.tensor([[0, 3]])),
        torch.full((1, 2), math.log(0.25)),
    )


def test_shape_and_setting_errors() -> None:
    ones = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages_B"):
        token_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), ones, CLIP)
    with pytest.raises(ValueError, match="old_logprobs_BT"):
        token_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), ones, CLIP)
    with pytest.raises(ValueError, match="unknown loss mode"):
        token_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.zeros(2),
            ones,
            LossParams(mode="ppo"),  # type: ignore[arg-type]
        )
    with pytest.raises(ValueError, match="temperature"):
        selected_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)
    for bad in (1.0, 0.5, 0.0):
        with pytest.raises(ValueError, match=f"dual_clip must be > 1 .*got {bad}"):
            token_loss(
                torch.zeros(2, 3),
                torch.zeros(2, 3),
                torch.zeros(2),
                ones,
                LossParams(dual_clip=bad),
            )


def test_params_from_config() -> None:
    cfg = LossConfig(mode="mask", clip_low=0.1, clip_high=0.3, kl_coef=0.05, kl_estimator="k1")
    assert LossParams.from_config(cfg) == LossParams(
        mode="mask", clip_low=0.1, clip_high=0.3, kl_coef=0.05, kl_estimator="k1", dual_clip=3.0
    )
    assert LossParams.from_config(LossConfig(dual_clip=2.5)).dual_clip == 2.5
    # 0 is how a config (TOML has no null) turns the dual clip off.
    assert LossParams.from_config(LossConfig(dual_clip=0)).dual_clip is None
