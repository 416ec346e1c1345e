"""The importance-sampled policy loss, normalised per run.

Rollouts are sampled by a policy ``mu`` that may lag the trained policy ``pi`` by up to
``max_async_level`` steps. For every completion token ``t`` of a sample with advantage ``A``::

    r_t = exp(logp_t - old_logp_t)            # pi / mu, old_logp from the RolloutBatch

    clip:  l_t = -min(r_t * A, clamp(r_t, 1 - clip_low, 1 + clip_high) * A)
    mask:  l_t = -r_t * A   if 1 - clip_low <= r_t <= 1 + clip_high
           l_t = 0          otherwise (the token is dropped: no loss, no gradient, no KL)

    k1:    kl_t = logp_t - ref_logp_t
    k3:    kl_t = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1

    loss_t = l_t + kl_coef * kl_t

``ref_logp`` comes from the same network with the run's adapter switched off (the base model).
``clip`` is PPO's clipped surrogate; ``mask`` is the masking variant of prime-rl's AIPO loss,
which drops a token whose ratio left the trust region instead of clipping its ratio, so stale
tokens neither push nor hold the policy.

Each run ``k`` is normalised by its own number of loss tokens in the whole step, ``N_k``,
which the packer counts before the first micro-batch runs::

    L_k = (1 / N_k) * sum_{t in run k} loss_t     (summed over all micro-batches of the step)

so a run's gradient is the mean over its tokens however its samples were split across
micro-batches, and a run with long completions does not outweigh one with short ones. The
total returned for backward is ``sum_k L_k``; runs own separate adapters, so each run's
parameters only ever see the gradient of its own ``L_k``.

Departures from the papers: the log-ratio is clamped to ``±LOG_RATIO_LIMIT`` before ``exp`` so
that one absurd sampling log-probability cannot overflow to ``inf`` and turn a run's whole
gradient into NaN (a token that far out of the trust region carries no policy gradient); and
the KL term is an estimate on the sampled tokens (drawn from ``mu``, not ``pi``), not an exact KL.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

if TYPE_CHECKING:
    from schemas.config import LossConfig

LOG_RATIO_LIMIT = 20.0
"""Bound on ``|logp - old_logp|`` and ``|ref_logp - logp|`` before exponentiation."""


@dataclass(frozen=True)
class LossParams:
    """The loss settings of one run (see :class:`schemas.config.LossConfig`)."""

    mode: Literal["clip", "mask"] = "clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k3"] = "k3"

    @classmethod
    def from_config(cls, cfg: LossConfig) -> LossParams:
        return cls(
            mode=cfg.mode,
            clip_low=cfg.clip_low,
            clip_high=cfg.clip_high,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
        )


@dataclass(frozen=True)
class TokenStats:
    """Per-token diagnostics of :func:`token_loss`, detached from the graph.

    ``clipped_BT`` marks loss tokens whose policy term carries no gradient because of the trust
    region: in ``clip`` mode the clipped branch won (``A > 0`` and ``r > 1 + clip_high``, or
    ``A < 0`` and ``r < 1 - clip_low``); in ``mask`` mode the ratio left the bounds.
    ``kl_BT`` is zero when no reference log-probabilities were given.
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
    if params.mode not in ("clip", "mask"):
        raise ValueError(f"unknown loss mode {params.mode!r}; use 'clip' or 'mask'")
    if params.kl_estimator not in ("k1", "k3"):
        raise ValueError(f"unknown KL estimator {params.kl_estimator!r}; use 'k1' or 'k3'")
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
    low, high = 1.0 - params.clip_low, 1.0 + params.clip_high

    if params.mode == "clip":
        unclipped_BT = ratio_BT * adv_BT
        clipped_BT = ratio_BT.clamp(low, high) * adv_BT
        policy_BT = -torch.minimum(unclipped_BT, clipped_BT)
        no_grad_BT = ((adv_BT > 0) & (ratio_BT > high)) | ((adv_BT < 0) & (ratio_BT < low))
        keep_BT = mask_BT
    else:
        no_grad_BT = (ratio_BT < low) | (ratio_BT > high)
        policy_BT = -ratio_BT * adv_BT
        keep_BT = mask_BT & ~no_grad_BT

    if ref_logprobs_BT is not None:
        log_ref_ratio_BT = torch.where(mask_BT, ref_logprobs_BT.to(dtype) - logprobs_BT, zero_BT)
        if params.kl_estimator == "k1":
            kl_BT = -log_ref_ratio_BT
        else:
            clamped_BT = log_ref_ratio_BT.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
            kl_BT = torch.exp(clamped_BT) - log_ref_ratio_BT - 1.0
    else:
        kl_BT = zero_BT

    loss_BT = torch.where(keep_BT, policy_BT + params.kl_coef * kl_BT, zero_BT)
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
