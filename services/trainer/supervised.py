"""Forward/backward over caller-supplied data: the training commands' losses and shared pass.

A ForwardBackwardRequest (``schemas/training.py``) carries, per sequence, the input tokens and
per-position inputs of one loss. Requests of several runs that arrive together go through the
model in shared micro-batches: every row is routed to its run's adapter slot, exactly as the
RolloutBatch path does, and one backward adds each run's gradients to its own slot, where they
stay until that run's ``optim_step``. Rows of a ``forward_only`` request run without gradients.

The losses are Tinker's built-ins, each a sum over the positions of every sequence (no
normalisation: the caller weights positions through ``weights`` or ``advantages``). With
``lp`` the log-probability of ``target_tokens[t]`` under the run's current adapter and ``q``
the sampling policy's (``logprobs`` of the request)::

    cross_entropy         loss_t = -w_t * lp_t                       (w_t = weights[t], default 1)
    importance_sampling   loss_t = -exp(lp_t - q_t) * A_t            (REINFORCE with an
                                                                       importance weight)
    ppo                   loss_t = -min(r_t * A_t, clip(r_t, lo, hi) * A_t),  r_t = exp(lp_t - q_t)
                          (Schulman et al. 2017, "Proximal Policy Optimization Algorithms";
                          lo, hi = clip_low_threshold, clip_high_threshold, default 0.8, 1.2)

``lp - q`` is bounded by ``LOG_RATIO_LIMIT`` before the exponential, as in the RolloutBatch
loss. A request whose loss is not finite is left out of the backward and answered with an error,
so it adds no gradient, and the other requests of the pass are unaffected (each run's slot
receives gradients only from its own rows). Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from schemas.training import LOSS_FN_INPUT_KEYS, LOSS_FNS, ForwardBackwardRequest
from services.trainer.loss import LOG_RATIO_LIMIT, selected_logprobs
from services.trainer.slots import WeightSlots

PPO_CLIP = (0.8, 1.2)
"""Tinker's default ``clip_low_threshold`` and ``clip_high_threshold`` of the ppo loss."""


class CommandError(ValueError):
    """A command that cannot be applied; the message is the ``error`` of its result."""


@dataclass
class FbOutcome:
    """What one ForwardBackwardRequest produced (or why it failed: ``error``)."""

    outputs: list[dict[str, list[float]]] = field(default_factory=list)
    loss: float = 0.0
    num_tokens: int = 0
    runs_in_pass: int = 0
    """how many runs' requests shared this request's forward/backward pass"""
    error: str | None = None


def check_request(req: ForwardBackwardRequest, vocab_size: int) -> None:
    """Refuse a request the pass cannot take, before anything is computed."""
    if req.loss_fn not in LOSS_FNS:
        raise CommandError(
            f"loss_fn {req.loss_fn!r} is not supported; plexrl implements {', '.join(LOSS_FNS)}"
        )
    needed = LOSS_FN_INPUT_KEYS[req.loss_fn]
    optional = {"weights"} if req.loss_fn == "cross_entropy" else set()
    for key in req.loss_fn_config or {}:
        if req.loss_fn != "ppo" or key not in ("clip_low_threshold", "clip_high_threshold"):
            raise CommandError(f"loss_fn_config key {key!r} does not apply to {req.loss_fn}")
    low, high = _clip_range(req)
    if not 0 <= low <= 1 <= high:
        raise CommandError(
            f"ppo clip thresholds must satisfy 0 <= low <= 1 <= high, not {low, high}"
        )
    for i, datum in enumerate(req.data):
        n = len(datum.model_input)
        unknown = set(datum.loss_fn_inputs) - set(needed)
        if unknown:
            raise CommandError(
                f"data[{i}]: loss_fn_inputs {sorted(unknown)} do not apply to {req.loss_fn} "
                f"(it takes {', '.join(needed)})"
            )
        for key in needed:
            values = datum.loss_fn_inputs.get(key)
            if values is None:
                if key in optional:
                    continue
                raise CommandError(f"data[{i}]: {req.loss_fn} needs loss_fn_inputs[{key!r}]")
            if len(values) != n:
                raise CommandError(
                    f"data[{i}]: loss_fn_inputs[{key!r}] has {len(values)} values for "
                    f"{n} input tokens; give one per input position"
                )
            if not all(math.isfinite(v) for v in values):
                raise CommandError(f"data[{i}]: loss_fn_inputs[{key!r}] holds NaN or infinity")
        tokens = [*datum.model_input, *(int(t) for t in datum.loss_fn_inputs["target_tokens"])]
        if any(t != int(t) for t in datum.loss_fn_inputs["target_tokens"]):
            raise CommandError(f"data[{i}]: target_tokens must be whole numbers")
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise CommandError(
                f"data[{i}]: token id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1})"
            )


def _clip_range(req: ForwardBackwardRequest) -> tuple[float, float]:
    cfg = req.loss_fn_config or {}
    return (
        float(cfg.get("clip_low_threshold", PPO_CLIP[0])),
        float(cfg.get("clip_high_threshold", PPO_CLIP[1])),
    )


def elementwise_loss(
    req: ForwardBackwardRequest, lp_T: Tensor, inputs: dict[str, Tensor]
) -> Tensor:
    """The per-position loss of one sequence under ``req.loss_fn`` (see the module docstring)."""
    if req.loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -lp_T if weights is None else -weights * lp_T
    log_ratio = (lp_T - inputs["logprobs"]).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)
    advantages = inputs["advantages"]
    if req.loss_fn == "importance_sampling":
        return -ratio * advantages
    low, high = _clip_range(req)
    return -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)


@dataclass
class _Row:
    request: int
    datum: int
    slot: int
    input_ids: list[int]
    inputs: dict[str, list[float]]


def forward_backward(
    model: torch.nn.Module,
    lora: WeightSlots,
    work: Sequence[tuple[int, ForwardBackwardRequest]],
    *,
    token_budget: int,
    pad_id: int,
    device: torch.device,
    grad_scale: float = 1.0,
) -> list[FbOutcome]:
    """Run every ``(slot, request)`` of ``work`` through the model together; one outcome each.

    Requests must have passed :func:`check_request`. Rows are cut into micro-batches of at most
    ``token_budget`` padded tokens (one row at least); a request's gradients, times
    ``grad_scale``, are added to its slot's ``.grad`` unless it is ``forward_only`` or its loss
    is not finite.
    """
    outcomes = [FbOutcome(runs_in_pass=len({slot for slot, _ in work})) for _ in work]
    rows = [
        _Row(i, j, slot, list(datum.model_input), dict(datum.loss_fn_inputs))
        for i, (slot, req) in enumerate(work)
        for j, datum in enumerate(req.data)
    ]
    for outcome, (_, req) in zip(outcomes, work, strict=True):
        outcome.outputs = [{} for _ in req.data]
    # A request's rows may span micro-batches, so its loss is known to be finite only after
    # the last one: each slot's gradients are kept as they were, and put back if it failed.
    trained = sorted({slot for slot, req in work if not req.forward_only})
    before = {slot: [_copy(p.grad) for p in lora.slot_parameters(slot)] for slot in trained}
    for grad in (False, True):
        chosen = [r for r in rows if work[r.request][1].forward_only != grad]
        for batch in _micro_batches(chosen, token_budget):
            _pass(model, lora, work, batch, outcomes, grad, pad_id, device, grad_scale)
    failed = {
        work[i][0]
        for i, outcome in enumerate(outcomes)
        if not work[i][1].forward_only and not math.isfinite(outcome.loss)
    }
    for slot in failed:
        for p, saved in zip(lora.slot_parameters(slot), before[slot], strict=True):
            p.grad = saved
    for i, outcome in enumerate(outcomes):
        slot, req = work[i]
        if not math.isfinite(outcome.loss):
            outcome.error = (
                f"non-finite loss ({outcome.loss}): the inputs drive {req.loss_fn} out of "
                "float range" + ("" if req.forward_only else "; no gradient was added")
            )
        elif slot in failed and not req.forward_only:
            outcome.error = (
                "another request of this run in the same pass had a non-finite loss, so the "
                "run's gradients of this pass were dropped; send this request again"
            )
        if outcome.error is not None:
            outcome.outputs = []
    return outcomes


def _copy(grad: Tensor | None) -> Tensor | None:
    return None if grad is None else grad.detach().clone()


def _micro_batches(rows: list[_Row], token_budget: int) -> list[list[_Row]]:
    ordered = sorted(rows, key=lambda r: (r.slot, -len(r.input_ids)))
    batches: list[list[_Row]] = []
    current: list[_Row] = []
    longest = 0
    for row in ordered:
        longest_next = max(longest, len(row.input_ids))
        if current and longest_next * (len(current) + 1) > token_budget:
            batches.append(current)
            current, longest_next = [], len(row.input_ids)
        current.append(row)
        longest = longest_next
    if current:
        batches.append(current)
    return batches


def _pass(
    model: torch.nn.Module,
    lora: WeightSlots,
    work: Sequence[tuple[int, ForwardBackwardRequest]],
    rows: list[_Row],
    outcomes: list[FbOutcome],
    grad: bool,
    pad_id: int,
    device: torch.device,
    grad_scale: float,
) -> None:
    width = max(len(r.input_ids) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        input_ids[b, :n] = torch.tensor(row.input_ids)
        targets[b, :n] = torch.tensor([int(t) for t in row.inputs["target_tokens"]])
        attention[b, :n] = 1
    slot_ids = torch.tensor([r.slot for r in rows], dtype=torch.long)
    with torch.set_grad_enabled(grad), lora.use(slot_ids.to(device)):
        logits = model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits
        logprobs = selected_logprobs(logits, targets.to(device))
        del logits
        terms: list[Tensor] = []
        for b, row in enumerate(rows):
            n = len(row.input_ids)
            req = work[row.request][1]
            inputs = {
                k: torch.tensor(v, dtype=torch.float32, device=device)
                for k, v in row.inputs.items()
                if k != "target_tokens"
            }
            lp = logprobs[b, :n]
            loss_T = elementwise_loss(req, lp, inputs)
            outcome = outcomes[row.request]
            outcome.outputs[row.datum] = {
                "logprobs": lp.detach().float().cpu().tolist(),
                "elementwise_loss": loss_T.detach().float().cpu().tolist(),
            }
            total = loss_T.sum()
            outcome.loss += float(total.detach())
            outcome.num_tokens += n
            if grad:
                terms.append(total)
        if grad:
            good = [t for t in terms if bool(torch.isfinite(t))]
            if good:
                total = torch.stack(good).sum()
                (total if grad_scale == 1.0 else total * grad_scale).backward()
