"""The loss at its edges: each trust region exactly at its bound (strict inequalities), zero and
fractional advantages, padded and one-token rows, log-ratios past the clamp, dtypes, and the
exact messages of refused inputs. The policy terms get hand-made inputs, ratios included, so a
bound is hit exactly rather than through ``exp``."""

from __future__ import annotations

import math
import re

import pytest
import torch

from schemas.config import LossConfig
from services.trainer.loss import (
    LOG_RATIO_LIMIT,
    LossParams,
    per_run_loss,
    run_stats,
    selected_logprobs,
    token_loss,
)
from services.trainer.policy_losses import POLICY_TERMS, Inputs


def _inputs(ratio, adv, *, logp=None, old=None, log_ratio=None, mask=None) -> Inputs:
    """One row per token unless given as rows; ratio and advantage per token."""
    ratio_BT = torch.tensor(ratio, dtype=torch.float64)
    ratio_BT = ratio_BT if ratio_BT.dim() == 2 else ratio_BT.unsqueeze(-1)
    adv_BT = torch.tensor(adv, dtype=torch.float64)
    adv_BT = adv_BT.unsqueeze(-1).expand_as(ratio_BT) if adv_BT.dim() == 1 else adv_BT
    zeros = torch.zeros_like(ratio_BT)
    return Inputs(
        logprobs_BT=zeros if logp is None else logp,
        old_logprobs_BT=zeros if old is None else old,
        log_ratio_BT=torch.log(ratio_BT) if log_ratio is None else log_ratio,
        ratio_BT=ratio_BT,
        adv_BT=adv_BT,
        mask_BT=torch.ones_like(ratio_BT, dtype=torch.bool) if mask is None else mask,
    )


def _flags(terms) -> list[bool]:
    return terms.no_grad_BT.flatten().tolist()


def test_clip_acts_only_strictly_past_its_bounds():
    params = LossParams(clip_low=0.5, clip_high=1.0, dual_clip=3.0)  # bounds 0.5 and 2.0
    ratio = [2.0, 0.5, 3.0, 4.0, 0.25, 0.25, 3.0, 2.5, 0.25]
    adv = [1.0, -1.0, 0.0, 0.0, 0.0, 0.5, -1.0, 0.5, -0.5]
    terms = POLICY_TERMS["clip"](_inputs(ratio, adv), params)
    # at a bound, a zero advantage (even past the dual clip), a fractional one below the low
    # bound and the dual clip's own bound: no clipping; past them: clipped
    assert _flags(terms) == [False] * 7 + [True, True]
    # -max(min(rA, clip(r)A), cA) where A < 0
    assert terms.loss_BT.flatten().tolist() == pytest.approx(
        [-2.0, 0.5, 0.0, 0.0, 0.0, -0.125, 3.0, -1.0, 0.25]
    )


@pytest.mark.parametrize("mode", ["mask", "cispo"])
def test_mask_and_cispo_act_only_strictly_past_their_bounds(mode):
    params = LossParams(mode=mode, clip_low=0.5, clip_high=1.0)
    terms = POLICY_TERMS[mode](_inputs([2.0, 0.5, 2.5, 0.25], [1.0, -1.0, 1.0, 1.0]), params)
    assert _flags(terms) == [False, False, True, True]
    if mode == "mask":
        assert terms.keep_BT.flatten().tolist() == [True, True, False, False]


def test_tis_truncates_only_strictly_above_its_cap():
    terms = POLICY_TERMS["tis"](_inputs([2.0, 2.5], [1.0, 1.0]), LossParams(tis_cap=2.0))
    assert _flags(terms) == [False, True]
    assert terms.loss_BT.flatten().tolist() == [-2.0, -2.0]


def test_gspo_at_its_bounds_and_over_padded_and_one_token_rows():
    # bounds 1 and 1 (clip 0): a sequence ratio of exactly 1 is at both
    params = LossParams(mode="gspo", clip_low=0.0, clip_high=0.0)
    log_ratio = torch.tensor(
        [
            [0.5, -0.5, 0.0],  # A = 1: s = 1, at the bound
            [0.5, -0.5, 0.0],  # A = -1: s = 1, at the bound
            [0.5, 0.5, 0.5],  # A = 0, s > 1
            [-0.5, -0.5, -0.5],  # A = 0, s < 1
            [0.5, 0.5, 0.5],  # A = 0.5, s > 1: clipped, loss at the bound
            [-0.5, -0.5, -0.5],  # A = 0.5, s < 1
            [0.5, -7.0, -9.0],  # A = 1, one loss token: s = e^0.5, the padding ignored
        ],
        dtype=torch.float64,
    )
    adv = [1.0, -1.0, 0.0, 0.0, 0.5, 0.5, 1.0]
    mask = torch.ones(7, 3, dtype=torch.bool)
    mask[6, 1:] = False
    inputs = _inputs(torch.exp(log_ratio).tolist(), adv, log_ratio=log_ratio, mask=mask)
    terms = POLICY_TERMS["gspo"](inputs, params)
    assert terms.no_grad_BT[:, 0].tolist() == [False, False, False, False, True, False, True]
    assert terms.no_grad_BT.all(dim=-1).tolist() == terms.no_grad_BT[:, 0].tolist()
    s = math.exp(-0.5)
    expected = [-1 / 3, 1 / 3, 0.0, 0.0, -0.5 / 3, -s * 0.5 / 3, -1.0]
    assert terms.loss_BT[:, 0].tolist() == pytest.approx(expected)
    assert terms.loss_BT.tolist() == [[x] * 3 for x in terms.loss_BT[:, 0].tolist()]


def test_dppo_drops_only_strictly_past_delta():
    logp = torch.tensor([[-0.3], [-0.9], [-0.9], [-0.3], [-0.9], [-0.3]])
    old = torch.tensor([[-0.9], [-0.3], [-0.3], [-0.9], [-0.3], [-0.9]])
    delta = float(torch.exp(logp[0]) - torch.exp(old[0]))  # exactly the first token's gain
    assert float(torch.exp(old[1]) - torch.exp(logp[1])) == delta  # and the second one's loss
    adv = [1.0, -1.0, 0.0, 0.0, 0.5, 0.5]
    inputs = _inputs(torch.exp(logp - old).flatten().tolist(), adv, logp=logp, old=old)
    terms = POLICY_TERMS["dppo"](inputs, LossParams(mode="dppo", tv_delta=delta * 0.999))
    # past delta: A > 0 gaining, A < 0 losing; never A = 0, nor A = 0.5 losing
    assert _flags(terms) == [True, True, False, False, False, True]
    at_delta = POLICY_TERMS["dppo"](inputs, LossParams(mode="dppo", tv_delta=delta))
    assert _flags(at_delta) == [False] * 6


def test_the_config_reaches_every_loss_parameter():
    cfg = LossConfig(
        mode="dppo",
        clip_low=0.1,
        clip_high=0.3,
        kl_coef=0.5,
        kl_estimator="k1",
        dual_clip=0.0,
        tv_delta=0.05,
        tis_cap=1.5,
    )
    assert LossParams.from_config(cfg) == LossParams(
        mode="dppo",
        clip_low=0.1,
        clip_high=0.3,
        kl_coef=0.5,
        kl_estimator="k1",
        dual_clip=None,
        tv_delta=0.05,
        tis_cap=1.5,
    )


def test_selected_logprobs_default_to_temperature_one_and_divide_by_another():
    logits = torch.tensor([[[1.0, 2.0, 4.0], [0.5, 0.0, -1.0]]])
    targets = torch.tensor([[2, 0]])
    plain = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selected_logprobs(logits, targets), plain)
    hot = torch.log_softmax(logits / 2.0, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selected_logprobs(logits, targets, 2.0), hot)
    with pytest.raises(ValueError, match=r"^logits \(1, 2, 3\) do not match targets \(1, 3\)$"):
        selected_logprobs(logits, torch.tensor([[2, 0, 1]]))


def test_refused_inputs_name_what_does_not_match():
    logp, adv = torch.zeros(2, 3), torch.zeros(2)
    mask, params = torch.ones(2, 3, dtype=torch.bool), LossParams()
    cases = [
        (
            (logp, torch.zeros(2, 4), adv, mask),
            "old_logprobs_BT (2, 4) does not match logprobs (2, 3)",
        ),
        ((logp, logp, adv, mask[:, :2]), "mask_BT (2, 2) does not match logprobs (2, 3)"),
        ((logp, logp, torch.zeros(3), mask), "advantages_B (3,) does not match 2 rows"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            token_loss(*args, params)
    with pytest.raises(
        ValueError, match=r"^ref_logprobs_BT \(2, 2\) does not match logprobs \(2, 3\)$"
    ):
        token_loss(logp, logp, adv, mask, params, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"^unknown KL estimator 'k2'; use 'k1' or 'k3'$"):
        token_loss(logp, logp, adv, mask, LossParams(kl_estimator="k2"))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^run_of_row_B \(3,\) does not match 2 rows$"):
        per_run_loss(logp, mask, torch.zeros(3, dtype=torch.long), {0: 1})


def test_the_loss_is_at_least_float32_whatever_comes_in():
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16)
    adv = torch.tensor([1.0], dtype=torch.float64)
    loss, stats = token_loss(logp, logp.float(), adv, mask, LossParams())
    assert loss.dtype == torch.float32 and stats.ratio_BT.dtype == torch.float32
    assert loss.tolist() == [[-1.0, -1.0]]
    # bfloat16 log-probabilities are taken exactly as the float32 they widen to, probabilities
    # included (dppo's trust region), however close to its bound
    logp = torch.tensor([[-0.30078125, -1.5]], dtype=torch.bfloat16)
    old = torch.tensor([[-0.5, -1.25]])
    gain = float(torch.exp(logp.float()[0, 0]) - torch.exp(old[0, 0]))
    for delta in (gain * 0.99, gain, gain * 1.01):
        params = LossParams(mode="dppo", tv_delta=delta)
        wide, wide_stats = token_loss(logp.float(), old, adv.float(), mask, params)
        narrow, narrow_stats = token_loss(logp, old, adv.float(), mask, params)
        assert torch.equal(narrow, wide) and torch.equal(
            narrow_stats.clipped_BT, wide_stats.clipped_BT
        )


def test_log_ratios_are_clamped_on_both_sides():
    limit = LOG_RATIO_LIMIT
    logp = torch.tensor([[0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-(limit + 10), limit + 10]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, stats = token_loss(logp, old, torch.tensor([1.0]), mask, LossParams(mode="tis"))
    assert stats.ratio_BT[0].tolist() == pytest.approx(
        [math.exp(limit), math.exp(-limit)], rel=1e-9
    )
    # gspo's sequence ratio is taken from the clamped log-ratios too
    for sign, a in ((1, -1.0), (-1, 1.0)):  # where the loss is s A, not the bound's
        row = torch.tensor([[0.0]], dtype=torch.float64)
        far = torch.tensor([[-sign * (limit + 10)]], dtype=torch.float64)
        loss, _ = token_loss(row, far, torch.tensor([a]), mask[:, :1], LossParams(mode="gspo"))
        s = math.exp(sign * limit)
        assert loss.item() == pytest.approx(-min(s * a, min(max(s, 0.8), 1.2) * a), rel=1e-9)
    # and the k3 estimate from the clamped reference log-ratio
    ref = torch.tensor([[limit + 10, -(limit + 10)]], dtype=torch.float64)
    _, stats = token_loss(logp, logp, torch.tensor([0.0]), mask, LossParams(kl_coef=0.1), ref)
    expected = [math.exp(limit) - (limit + 10) - 1, math.exp(-limit) + (limit + 10) - 1]
    assert stats.kl_BT[0].tolist() == pytest.approx(expected, rel=1e-12)


def test_a_micro_batch_without_rows_or_without_loss_tokens():
    loss = torch.zeros(0, 3, requires_grad=True)
    total, per_run = per_run_loss(loss, torch.zeros(0, 3), torch.zeros(0, dtype=torch.long), {})
    assert per_run == {} and total.item() == 0.0
    # a run whose rows hold no loss token: counted, with no ratio
    mask = torch.zeros(1, 2, dtype=torch.bool)
    logp = torch.zeros(1, 2)
    _, stats = token_loss(logp, logp, torch.tensor([1.0]), mask, LossParams())
    [(slot, s)] = run_stats(stats, mask, torch.tensor([4])).items()
    assert slot == 4 and (s.num_tokens, s.ratio_sum, s.ratio_max) == (0, 0.0, 0.0)
