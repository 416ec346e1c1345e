"""The policy terms ``loss.mode`` selects, each a pure function of one micro-batch's tensors.

Notation as in :mod:`services.trainer.loss`: ``logp`` the trained policy's log-probability of a
sampled token, ``q`` the sampling policy's (``old_logprobs``), ``r = exp(logp - q)``, ``A`` the
token's advantage, ``lo = 1 - clip_low``, ``hi = 1 + clip_high``, ``sg`` stop-gradient. Every
function returns the per-token policy loss ``l_t``, which tokens enter the loss at all
(``keep``), and which the trust region acted on (``no_grad``, the "clipped" diagnostic: no
gradient or dropped, or for cispo and tis a clipped weight).

``clip``  PPO's clipped surrogate with dual clip (Schulman et al. 2017; Ye et al. 2020)::

    l_t = -max(min(r A, clip(r, lo, hi) A), c A)     (the max only where A < 0 and c is set)

``mask``  token-level masked importance sampling (IcePop, Ling Team 2025; prime-rl)::

    l_t = -r A where lo <= r <= hi, the token dropped elsewhere

``cispo`` clipped IS-weight policy optimisation (MiniMax 2025, "MiniMax-M1", section 3.1)::

    l_t = -sg(clip(r, lo, hi)) A logp

  The weight is clipped, never the token: every token keeps a gradient, scaled by at most ``hi``.

``gspo``  group sequence policy optimisation (Zheng et al. 2025, "Group Sequence Policy
  Optimization"): one ratio per sequence, the geometric mean of its tokens' ratios,
  ``s = exp(mean_t (logp_t - q_t))``, clipped as PPO clips::

    l_seq = -min(s A, clip(s, lo, hi) A)

  spread over the sequence's ``n`` tokens as ``l_t = l_seq / n`` (so the run's per-token
  normalisation weighs a sequence by its length; GSPO's paper divides by the group size, a
  constant factor apart within a step). Its ``clip_low`` / ``clip_high`` are small (the paper
  uses 3e-4 and 4e-4): a sequence ratio moves far less than a token's.

``dppo``  divergence PPO, binary total-variation variant (Qi et al. 2026, "Rethinking the Trust
  Region in LLM Reinforcement Learning"): the trust region is on the probability, not the
  ratio. With ``p = exp(logp)``, ``p_old = exp(q)`` and ``delta = tv_delta``::

    l_t = -r A, the token dropped where A > 0 and p - p_old > delta, or A < 0 and p_old - p > delta

  A rare token (small ``p_old``) may change its ratio a lot before it moves ``delta`` of
  probability mass, a likely one little; the ratio's fixed bounds treat both alike.

``tis``   truncated importance sampling (Espeholt et al. 2018, "IMPALA", the truncated weight
  of V-trace; Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
  Training", for the mismatch between the inference engine's and the trainer's probabilities)::

    l_t = -sg(min(r, tis_cap)) A logp

  No token is dropped or clipped to zero gradient; the weight is only bounded above.

The stop-gradient losses are written ``-sg(w) A exp(logp - sg(logp))``: the same gradient as
``-sg(w) A logp``, and the value ``-w A`` that the other modes have at the same ``w``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from services.trainer.loss import LossParams

MODES = ("clip", "mask", "cispo", "gspo", "dppo", "tis")


@dataclass(frozen=True)
class PolicyTerms:
    loss_BT: Tensor
    """the per-token policy loss (KL not included); meaningful where ``keep_BT``"""
    keep_BT: Tensor
    """bool: tokens that enter the loss"""
    no_grad_BT: Tensor
    """bool: tokens the trust region acted on: clipped to no gradient or dropped (clip, mask,
    gspo, dppo), or whose importance weight was clipped or truncated (cispo, tis)"""


@dataclass(frozen=True)
class Inputs:
    logprobs_BT: Tensor
    old_logprobs_BT: Tensor
    log_ratio_BT: Tensor
    """``logp - q`` on loss tokens, 0 elsewhere, clamped to the loss's limit"""
    ratio_BT: Tensor
    adv_BT: Tensor
    mask_BT: Tensor


def _weighted_logp(weight_BT: Tensor, inp: Inputs) -> Tensor:
    """``-sg(w) A exp(logp - sg(logp))``: gradient ``-w A grad logp``, value ``-w A``."""
    unit_BT = torch.exp(inp.logprobs_BT - inp.logprobs_BT.detach())
    return -weight_BT.detach() * inp.adv_BT * unit_BT


def clip(inp: Inputs, params: LossParams) -> PolicyTerms:
    low, high = 1.0 - params.clip_low, 1.0 + params.clip_high
    ratio, adv = inp.ratio_BT, inp.adv_BT
    surrogate = torch.minimum(ratio * adv, ratio.clamp(low, high) * adv)
    no_grad = ((adv > 0) & (ratio > high)) | ((adv < 0) & (ratio < low))
    if params.dual_clip is not None:
        negative = adv < 0
        surrogate = torch.where(
            negative, torch.maximum(surrogate, params.dual_clip * adv), surrogate
        )
        no_grad = no_grad | (negative & (ratio > params.dual_clip))
    return PolicyTerms(-surrogate, inp.mask_BT, no_grad)


def mask(inp: Inputs, params: LossParams) -> PolicyTerms:
    low, high = 1.0 - params.clip_low, 1.0 + params.clip_high
    dropped = (inp.ratio_BT < low) | (inp.ratio_BT > high)
    return PolicyTerms(-inp.ratio_BT * inp.adv_BT, inp.mask_BT & ~dropped, dropped)


def cispo(inp: Inputs, params: LossParams) -> PolicyTerms:
    low, high = 1.0 - params.clip_low, 1.0 + params.clip_high
    weight = inp.ratio_BT.clamp(low, high)
    clipped = (inp.ratio_BT < low) | (inp.ratio_BT > high)
    return PolicyTerms(_weighted_logp(weight, inp), inp.mask_BT, clipped)


def gspo(inp: Inputs, params: LossParams) -> PolicyTerms:
    low, high = 1.0 - params.clip_low, 1.0 + params.clip_high
    mask_f = inp.mask_BT.to(inp.log_ratio_BT.dtype)
    n_B = mask_f.sum(dim=-1).clamp_min(1.0)
    seq_ratio_B = torch.exp((inp.log_ratio_BT * mask_f).sum(dim=-1) / n_B)
    # every token of a row carries its row's advantage
    adv_B = (inp.adv_BT * mask_f).sum(dim=-1) / n_B
    surrogate_B = torch.minimum(seq_ratio_B * adv_B, seq_ratio_B.clamp(low, high) * adv_B)
    no_grad_B = ((adv_B > 0) & (seq_ratio_B > high)) | ((adv_B < 0) & (seq_ratio_B < low))
    loss_BT = (-surrogate_B / n_B).unsqueeze(-1).expand_as(inp.log_ratio_BT)
    return PolicyTerms(loss_BT, inp.mask_BT, no_grad_B.unsqueeze(-1).expand_as(inp.mask_BT))


def dppo(inp: Inputs, params: LossParams) -> PolicyTerms:
    p = torch.exp(inp.logprobs_BT)
    p_old = torch.exp(inp.old_logprobs_BT.to(p.dtype))
    delta = params.tv_delta
    dropped = ((inp.adv_BT > 0) & (p - p_old > delta)) | ((inp.adv_BT < 0) & (p_old - p > delta))
    return PolicyTerms(-inp.ratio_BT * inp.adv_BT, inp.mask_BT & ~dropped, dropped)


def tis(inp: Inputs, params: LossParams) -> PolicyTerms:
    weight = inp.ratio_BT.clamp(max=params.tis_cap)
    truncated = inp.ratio_BT > params.tis_cap
    return PolicyTerms(_weighted_logp(weight, inp), inp.mask_BT, truncated)


POLICY_TERMS: dict[str, Callable[[Inputs, LossParams], PolicyTerms]] = {
    "clip": clip,
    "mask": mask,
    "cispo": cispo,
    "gspo": gspo,
    "dppo": dppo,
    "tis": tis,
}
assert tuple(POLICY_TERMS) == MODES
