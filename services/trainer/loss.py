"""The importance-sampled policy loss, normalised per run.

Rollouts are sampled by a policy ``mu`` that may lag the trained policy ``pi`` by up to
``max_async_level`` steps. Every completion token ``t`` of a sample carries the sample's
advantage ``A`` (group-relative, the same for all its tokens) and::

    r_t = exp(logp_t - old_logp_t)            # pi / mu, old_logp from the RolloutBatch

Policy term (``loss.mode``; ``lo = 1 - clip_low``, ``hi = 1 + clip_high``, ``c = dual_clip``;
the other modes, ``cispo``, ``gspo``, ``dppo`` and ``tis``, are described with their sources in
:mod:`services.trainer.policy_losses`)::

    clip:  s_t = min(r_t * A, clamp(r_t, lo, hi) * A)
           s_t = max(s_t, c * A)          only where A < 0, unless dual_clip = 0 (off)
           l_t = -s_t
    mask:  l_t = -r_t * A   if lo <= r_t <= hi
           l_t = 0          otherwise (the token is dropped: no loss, no gradient, no KL)

KL term against the reference ``ref`` (``loss.kl_estimator``, only when ``kl_coef > 0``)::

    k1_t = logp_t - ref_logp_t
    k3_t = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1

    k3:    loss_t = l_t + kl_coef * k3_t                    (k3 is a loss term)
    k1:    loss_t = l_t computed with A_t = A - kl_coef * sg(k1_t) in place of A
                                                            (k1 is a reward penalty)

where ``sg`` stops the gradient. ``ref_logp`` comes from the same network with the run's
adapter switched off (the base model), at the run's sampling temperature.

Sources, and what each piece is for:

- ``clip`` is PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization
  Algorithms"), applied per token as in GRPO (Shao et al. 2024, "DeepSeekMath"), with separate
  low and high bounds (DAPO's "clip-higher", Yu et al. 2025). A token gets no gradient when the
  clipped branch wins: ``A > 0`` and ``r > hi``, or ``A < 0`` and ``r < lo``.
- The dual clip is dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with
  Deep Reinforcement Learning"). With ``A < 0`` PPO's ``min`` keeps ``r * A`` however large
  ``r`` grows, so a stale token that ``pi`` now likes far more than ``mu`` did has a loss
  ``-r * A = r * |A|`` without bound (up to ``exp(LOG_RATIO_LIMIT) * |A|``) and can dominate its
  run's gradient. The dual clip bounds that loss by ``-c * A = c * |A|``: it binds exactly
  where ``A < 0`` and ``r > c`` (the loss is then the constant ``c * |A|``, no gradient). It
  needs ``c > 1``; the default ``c = 3`` leaves every token with ``r <= 3`` as PPO had it.
- ``mask`` is token-level masked importance sampling, the two-sided rule of IcePop (Ling Team
  2025, "Every Step Evolves: Scaling Reinforcement Learning for Trillion-Scale Thinking Model")
  and of prime-rl's masked importance ratio: a token whose ratio left ``[lo, hi]`` is dropped
  *whatever the sign of A*. It does not follow the sign of the advantage like the clip: it also
  drops the two cases the clip keeps because their gradient pulls ``r`` back towards 1 (``A > 0``
  with ``r < lo``, ``A < 0`` with ``r > hi``). A ratio that far from 1 is read as a token whose
  sampling log-probability no longer describes ``pi`` (too stale, or a mismatched inference
  engine), so it neither pushes nor holds the policy. The dual clip does not apply: a kept
  token has ``r <= hi``, so its loss is already bounded by ``hi * |A|``.
- The estimators are Schulman's (2020, "Approximating KL Divergence", joschu.net/blog/kl-approx):
  on tokens drawn from ``pi`` both ``k1`` and ``k3`` are unbiased estimates of the *value* of
  ``KL(pi || ref)``; ``k1`` has high variance and can be negative, ``k3`` is never negative and
  has low variance. Their *gradients* differ (Tang & Munos 2025, "On a few pitfalls in KL
  divergence gradient estimation for RL"):

  * ``k1`` differentiated as a loss gives ``grad logp``, whose expectation under ``pi`` is zero:
    it never pulls ``pi`` towards ``ref``. So ``k1`` is used where it is right, as a reward: it
    is subtracted, without gradient, from the token's advantage (the KL-in-reward of Ziegler et
    al. 2019 and Ouyang et al. 2022). Its gradient ``kl_coef * k1 * r * grad logp`` then has
    expectation ``kl_coef * grad KL(pi || ref)`` per token, also on samples from ``mu``, because
    the penalty sits inside the importance ratio (and is clipped or masked with the reward).
  * ``k3`` differentiated as a loss (GRPO's KL term) gives ``(1 - ref / pi) * grad logp``, whose
    expectation under ``pi`` is ``grad KL(ref || pi)``: the gradient of the *reverse-direction*
    KL. It vanishes at ``pi = ref`` and agrees with ``grad KL(pi || ref)`` to second order near
    it, so it is a sound low-variance penalty towards the base model; it is the default.

  ``kl_estimator = "k1"`` once meant ``kl_coef * k1`` added to the loss (zero expected
  gradient). Such configs still load and now get the reward penalty: the loss value at
  ``r = 1`` is the same, ``-A + kl_coef * k1``, and its gradient is now the KL's.

Each run ``k`` is normalised by its own number of loss tokens in the whole step, ``N_k``,
which the packer counts before the first micro-batch runs (``loss.normalize = "constant"``
puts the run's samples times ``sampling.max_tokens`` in its place, Dr. GRPO's rule)::

    L_k = (1 / N_k) * sum_{t in run k} loss_t     (summed over all micro-batches of the step)

so a run's gradient is the mean over its tokens however its samples were split across
micro-batches, and a run with long completions does not outweigh one with short ones. The
total returned for backward is ``sum_k L_k``; runs own separate adapters, so each run's
parameters only ever see the gradient of its own ``L_k``.

Departures from the papers: the log-ratio is clamped to ``±LOG_RATIO_LIMIT`` before ``exp`` so
that one absurd sampling log-probability cannot overflow to ``inf`` and turn a run's whole
gradient into NaN (a token that far out of the trust region carries no policy gradient). The KL
terms are per token: ``k1``'s penalty of a token reaches only that token's advantage, not the
earlier tokens that led to it (Tang & Munos call this the partial gradient of the sequence KL),
and ``k3`` is evaluated on tokens drawn from ``mu`` without an importance weight, so it is
exact only on-policy and off by ``O(r - 1)`` inside the trust region.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from services.trainer.policy_losses import MODES, POLICY_TERMS, Inputs

if TYPE_CHECKING:
    from schemas.config import LossConfig

LOG_RATIO_LIMIT = 20.0
"""Bound on ``|logp - old_logp|`` and ``|ref_logp - logp|`` before exponentiation."""


@dataclass(frozen=True)
class LossParams:
    """The loss settings of one run (see :class:`schemas.config.LossConfig`)."""

    mode: Literal["clip", "mask", "cispo", "gspo", "dppo", "tis"] = "clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"
    dual_clip: float | None = 3.0
    """``c`` of the dual clip (``clip`` mode, ``A < 0``); None turns it off."""
    tv_delta: float = 0.2
    """``dppo``: how much probability a token may gain (A > 0) or lose (A < 0) and still count"""
    tis_cap: float = 2.0
    """``tis``: the importance weight's upper bound"""

    @classmethod
    def from_config(cls, cfg: LossConfig) -> LossParams:
        return cls(
            mode=cfg.mode,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            # The config spells "off" as 0, which TOML can write (it has no null).
            dual_clip=cfg.dual_clip if cfg.dual_clip > 0 else None,
            tv_delta=cfg.tv_delta,
            tis_cap=cfg.tis_cap,
        )


@dataclass(frozen=True)
class TokenStats:
    """Per-token diagnostics of :func:`token_loss`, detached from the graph.

    ``clipped_BT`` marks loss tokens whose policy term carries no gradient because of the trust
    region: in ``clip`` mode the clipped branch won (``A > 0`` and ``r > 1 + clip_high``, or
    ``A < 0`` and ``r < 1 - clip_low``) or the dual clip bound (``A < 0`` and ``r > dual_clip``);
    in ``mask`` mode the ratio left the bounds. ``A`` is the token's advantage, penalised by
    ``k1`` when that is the estimator. ``kl_BT`` holds the estimator's value (``k1`` or ``k3``),
    zero when no reference log-probabilities were given.
    """

    ratio_BT: Tensor
    clipped_BT: Tensor
    kl_BT: Tensor


@dataclass(frozen=True)
class RunLossStats:
    """Loss diagnostics of one run, as sums so that micro-batches (and ranks) add up."""

    num_tokens: int = 0
    num_clipped: int = 0
    ratio_sum: float = 0.0
    ratio_max: float = 0.0
    kl_sum: float = 0.0

    @property
    def clipped_fraction(self) -> float:
        return self.num_clipped / self.num_tokens if self.num_tokens else 0.0

    @property
    def ratio_mean(self) -> float:
        return self.ratio_sum / self.num_tokens if self.num_tokens else 0.0

    @property
    def kl_mean(self) -> float:
        return self.kl_sum / self.num_tokens if self.num_tokens else 0.0


def selected_logprobs(
    logits_BTV: Tensor, target_ids_BT: Tensor, temperature: float = 1.0
) -> Tensor:
    """``log softmax(logits / temperature)[target]`` at every position, in float32 or wider.

    Computed as ``logit[target] - logsumexp(logits)`` rather than through ``log_softmax``:
    autograd then keeps only the logits it already holds plus a ``[B, T]`` result, instead of a
    second ``[B, T, V]`` tensor, which is the largest activation of a small-vocabulary model.
    ``temperature`` must match the one the samples were drawn with, or the importance ratio
    compares two different distributions.
    """
    if logits_BTV.shape[:-1] != target_ids_BT.shape:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} do not match targets {tuple(target_ids_BT.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits_BTV = logits_BTV.to(torch.promote_types(logits_BTV.dtype, torch.float32))
    if temperature != 1.0:
        logits_BTV = logits_BTV / temperature
    target_logits_BT = logits_BTV.gather(-1, target_ids_BT.long().unsqueeze(-1)).squeeze(-1)
    return target_logits_BT - torch.logsumexp(logits_BTV, dim=-1)


def token_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    params: LossParams,
    ref_logprobs_BT: Tensor | None = None,
) -> tuple[Tensor, TokenStats]:
    """The per-token loss ``loss_t`` of the module docstring; exactly zero where ``mask_BT`` is 0.

    Padding never reaches ``exp``: the log-ratio is zeroed there first, so whatever the model
    computes at padded positions cannot produce ``inf`` or NaN in the loss or its gradient.
    """
    if params.mode not in POLICY_TERMS:
        raise ValueError(f"unknown loss mode {params.mode!r}; use one of {', '.join(MODES)}")
    if params.kl_estimator not in ("k1", "k3"):
        raise ValueError(f"unknown KL estimator {params.kl_estimator!r}; use 'k1' or 'k3'")
    if params.dual_clip is not None and not params.dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None: off), got {params.dual_clip}")
    shape = logprobs_BT.shape
    for name, t in (("old_logprobs_BT", old_logprobs_BT), ("mask_BT", mask_BT)):
        if t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} does not match logprobs {tuple(shape)}")
    if ref_logprobs_BT is not None and ref_logprobs_BT.shape != shape:
        raise ValueError(
            f"ref_logprobs_BT {tuple(ref_logprobs_BT.shape)} does not match logprobs {tuple(shape)}"
        )
    if advantages_B.shape != shape[:1]:
        raise ValueError(f"advantages_B {tuple(advantages_B.shape)} does not match {shape[0]} rows")

    # At least float32: bf16 log-probs would put a ~1% error on every ratio.
    dtype = torch.promote_types(logprobs_BT.dtype, torch.float32)
    mask_BT = mask_BT.bool()
    logprobs_BT = logprobs_BT.to(dtype)
    adv_BT = advantages_B.to(dtype).unsqueeze(-1).expand(shape)
    zero_BT = torch.zeros_like(logprobs_BT)

    log_ratio_BT = torch.where(mask_BT, logprobs_BT - old_logprobs_BT.to(dtype), zero_BT)
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    kl_BT = zero_BT
    kl_loss_BT = zero_BT
    if ref_logprobs_BT is not None:
        log_ref_ratio_BT = torch.where(mask_BT, ref_logprobs_BT.to(dtype) - logprobs_BT, zero_BT)
        if params.kl_estimator == "k1":
            kl_BT = -log_ref_ratio_BT
            # A reward penalty: no gradient through k1 itself, only through the ratio.
            adv_BT = adv_BT - params.kl_coef * kl_BT.detach()
        else:
            clamped_BT = log_ref_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
            kl_BT = torch.exp(clamped_BT) - log_ref_ratio_BT - 1.0
            kl_loss_BT = params.kl_coef * kl_BT

    terms = POLICY_TERMS[params.mode](
        Inputs(
            logprobs_BT=logprobs_BT,
            old_logprobs_BT=old_logprobs_BT,
            log_ratio_BT=log_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT),
            ratio_BT=ratio_BT,
            adv_BT=adv_BT,
            mask_BT=mask_BT,
        ),
        params,
    )
    policy_BT, keep_BT, no_grad_BT = terms.loss_BT, terms.keep_BT, terms.no_grad_BT

    loss_BT = torch.where(keep_BT, policy_BT + kl_loss_BT, zero_BT)
    stats = TokenStats(
        ratio_BT=ratio_BT.detach(),
        clipped_BT=(no_grad_BT & mask_BT).detach(),
        kl_BT=torch.where(mask_BT, kl_BT, zero_BT).detach(),
    )
    return loss_BT, stats


def per_run_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    run_of_row_B: Tensor,
    tokens_per_run: Mapping[int, int] | Tensor,
) -> tuple[Tensor, dict[int, Tensor]]:
    """Sum each run's token losses in this micro-batch and divide by its step-wide token count.

    ``run_of_row_B`` holds each row's run slot; ``tokens_per_run[slot]`` is that run's number of
    loss tokens over *all* micro-batches of the step (``PackedStep.tokens_per_run``), so adding
    the returned losses over the micro-batches of a step gives each run's token mean. Returns the
    sum over runs (what to call ``backward`` on) and each run's share.
    """
    if run_of_row_B.shape != loss_BT.shape[:1]:
        raise ValueError(
            f"run_of_row_B {tuple(run_of_row_B.shape)} does not match {loss_BT.shape[0]} rows"
        )
    row_sum_B = torch.where(mask_BT.bool(), loss_BT, torch.zeros_like(loss_BT)).sum(dim=-1)
    per_run: dict[int, Tensor] = {}
    for slot in run_of_row_B.unique().tolist():
        count = int(tokens_per_run[slot])
        # A run whose rows hold no loss tokens has a zero sum; max(1) only avoids 0/0.
        per_run[slot] = row_sum_B[run_of_row_B == slot].sum() / max(count, 1)
    total = torch.stack(list(per_run.values())).sum() if per_run else row_sum_B.sum() * 0.0
    return total, per_run


def run_stats(stats: TokenStats, mask_BT: Tensor, run_of_row_B: Tensor) -> dict[int, RunLossStats]:
    """Sum :class:`TokenStats` over each run's loss tokens in one micro-batch."""
    mask_BT = mask_BT.bool()
    out: dict[int, RunLossStats] = {}
    for slot in run_of_row_B.unique().tolist():
        tokens_BT = mask_BT & (run_of_row_B == slot).unsqueeze(-1)
        ratios = stats.ratio_BT[tokens_BT]
        out[slot] = RunLossStats(
            num_tokens=int(tokens_BT.sum()),
            num_clipped=int((stats.clipped_BT & tokens_BT).sum()),
            ratio_sum=float(ratios.sum()),
            ratio_max=float(ratios.max()) if ratios.numel() else 0.0,
            kl_sum=float(stats.kl_BT[tokens_BT].sum()),
        )
    return out
