"""One trainer step over several runs: pack, forward/backward, per-run checks, per-run update.

Given at most one RolloutBatch per run (``(slot, batch)`` pairs), a step

1. packs every run's samples into shared micro-batches (``pack_step``); a run whose batch is
   invalid (lengths, out-of-vocabulary tokens, non-finite inputs) is left out and refused;
2. for each of this rank's micro-batches: one forward with every row routed to its run's adapter
   slot, log-probabilities at the run's sampling temperature, and, for runs with
   ``kl_coef > 0``, a no-grad forward of their rows with the adapter off (slot -1, the base
   model) as the KL reference; the token loss with each run's own loss settings, normalised per
   run over the whole step (``per_run_loss``); a run whose loss is not finite is left out of the
   sum *before* backward, so its NaN cannot reach the shared backward; then one backward;
3. after the last micro-batch (and the all-reduce across ranks): per run, a non-finite loss or
   gradient refuses the run (its gradients are dropped and its optimizer does not step);
   otherwise its gradients are clipped to its ``max_grad_norm``, its AdamW steps and its
   scheduler advances.

A run's optimizer therefore steps only when its whole batch has been through backward, and a
run absent from the step, or refused, keeps its adapter and optimizer bit for bit.

On sharded ranks (``ranks.lockstep``) every forward and backward gathers or reduces across the
ranks, so they must make the same ones: a rank with fewer micro-batches than the busiest makes a
zero-loss pass for each one it lacks, every pass makes a reference forward when any run of the
step has a KL penalty, and a pass whose losses are all refused still runs a zero backward.

The executor does no I/O: the service decides what to publish, ack, checkpoint or evict from the
report.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from schemas.events import RolloutBatch
from services.model.routing import NO_ADAPTER
from services.trainer.distributed import SINGLE, Ranks
from services.trainer.loss import (
    LossParams,
    RunLossStats,
    per_run_loss,
    run_stats,
    selected_logprobs,
    token_loss,
)
from services.trainer.packer import MicroBatch, pack_step
from services.trainer.slots import WeightSlots
from services.trainer.state import RunState

# Per-run sums carried through the all-reduce, in this order.
_LOSS, _BAD, _TOKENS, _CLIPPED, _RATIO, _KL = range(6)
_NUM_EXTRAS = 6


@dataclass(frozen=True)
class RunResult:
    """What one step did for one run."""

    slot: int
    run_id: str
    step: int
    """the RolloutBatch step trained (or refused)"""
    trained: bool
    reason: str | None = None
    """why the run's step was refused: the eviction reason"""
    loss: float = 0.0
    num_tokens: int = 0
    """prompt + completion tokens of the run's samples"""
    num_samples: int = 0
    grad_norm: float = 0.0
    """total gradient norm before clipping"""
    lr: float = 0.0
    """learning rate this step used"""
    reward_mean: float = 0.0
    stats: RunLossStats = field(default_factory=RunLossStats)


@dataclass(frozen=True)
class StepReport:
    """Per-run results and the timing of the shared phases (``time.time_ns`` stamps)."""

    runs: dict[int, RunResult]
    phases: dict[str, tuple[int, int]]
    """phase name ('pack', 'forward_backward', 'optimizer') -> (start_ns, end_ns)"""


class StepExecutor:
    """Runs trainer steps on one model whose target linears carry a :class:`MultiLoRA`, or
    whose own parameters are trained (:class:`FullWeights`, one run)."""

    def __init__(
        self,
        model: Any,
        lora: WeightSlots,
        *,
        token_budget: int,
        pad_id: int,
        vocab_size: int,
        device: torch.device | str = "cpu",
        ranks: Ranks = SINGLE,
    ) -> None:
        self.model = model
        self.lora = lora
        self.token_budget = token_budget
        self.pad_id = pad_id
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.ranks = ranks

    def run(
        self, work: Sequence[tuple[int, RolloutBatch]], states: Mapping[int, RunState]
    ) -> StepReport:
        """Train one step of every run in ``work``; ``states[slot]`` is that run's state."""
        t_pack = time.time_ns()
        work = sorted(work, key=lambda w: w[0])
        packed = pack_step(
            work, token_budget=self.token_budget, pad_id=self.pad_id, vocab_size=self.vocab_size
        )
        slots = sorted(packed.run_ids)
        denominators = _denominators(packed.tokens_per_run, dict(work), states)
        t_fb = time.time_ns()

        extras = torch.zeros(len(slots), _NUM_EXTRAS, dtype=torch.float64, device=self.device)
        ratio_max = torch.zeros(len(slots), dtype=torch.float64, device=self.device)
        row_of = {slot: i for i, slot in enumerate(slots)}
        mine = packed.micro_batches[self.ranks.rank :: self.ranks.world_size]
        # Sharded, every forward and backward gathers from every rank: each rank makes as many
        # as the busiest one, and a reference forward in each if any run of the step has one.
        lockstep = self.ranks.lockstep
        reference = lockstep and any(states[s].loss_params.kl_coef > 0 for s in slots)
        for mb in mine:
            self._forward_backward(
                mb, denominators, states, extras, ratio_max, row_of, reference=reference
            )
        if lockstep and packed.micro_batches:
            busiest = -(-len(packed.micro_batches) // self.ranks.world_size)
            for _ in range(busiest - len(mine)):
                self._idle_pass(packed.micro_batches[0], reference=reference)
        t_opt = time.time_ns()

        params = [p for slot in slots for p in self.lora.slot_parameters(slot)]
        extras = self.ranks.sum_grads(params, extras)
        ratio_max = self.ranks.max(ratio_max)

        results: dict[int, RunResult] = {}
        for slot, batch in work:
            state = states[slot]
            if batch.run_id in packed.rejected:
                results[slot] = _refused(
                    slot, batch, f"rejected batch: {packed.rejected[batch.run_id]}"
                )
                continue
            row = extras[row_of[slot]].tolist()
            stats = RunLossStats(
                num_tokens=int(row[_TOKENS]),
                num_clipped=int(row[_CLIPPED]),
                ratio_sum=row[_RATIO],
                ratio_max=float(ratio_max[row_of[slot]]),
                kl_sum=row[_KL],
            )
            results[slot] = self._update(state, batch, row[_LOSS], row[_BAD] > 0, stats)
        t_end = time.time_ns()
        return StepReport(
            runs=results,
            phases={
                "pack": (t_pack, t_fb),
                "forward_backward": (t_fb, t_opt),
                "optimizer": (t_opt, t_end),
            },
        )

    # --- forward and backward ----------------------------------------------------------------

    def _forward_backward(
        self,
        mb: MicroBatch,
        tokens_per_run: Mapping[int, int],
        states: Mapping[int, RunState],
        extras: Tensor,
        ratio_max: Tensor,
        row_of: Mapping[int, int],
        *,
        reference: bool = False,
    ) -> None:
        mb = _rows_by_slot(mb)
        dev = self.device
        input_ids = mb.input_ids_BT.to(dev)
        attention = mb.attention_mask_BT.to(dev)
        targets = mb.target_ids_BT.to(dev)
        loss_mask = mb.loss_mask_BT.to(dev)
        old_logprobs = mb.old_logprobs_BT.to(dev)
        advantages = mb.advantages_B.to(dev)
        slot_ids = mb.slot_ids_B.to(dev)
        temps = torch.tensor(
            [states[s].temperature for s in mb.slot_ids_B.tolist()], dtype=torch.float32
        ).to(dev)
        kl_rows = torch.tensor(
            [states[s].loss_params.kl_coef > 0 for s in mb.slot_ids_B.tolist()], dtype=torch.bool
        ).to(dev)

        ref_logprobs = None
        if bool(kl_rows.any()):
            # The reference policy is the base model: the same network with the adapter off.
            with torch.no_grad(), self.lora.use(torch.full((int(kl_rows.sum()),), NO_ADAPTER)):
                ref_logits = self.model(
                    input_ids=input_ids[kl_rows], attention_mask=attention[kl_rows]
                ).logits
                ref_logprobs = torch.zeros_like(old_logprobs)
                ref_logprobs[kl_rows] = _logprobs(ref_logits, targets[kl_rows], temps[kl_rows])
                del ref_logits
        elif reference:
            self._reference_forward(input_ids[:1], attention[:1])

        with self.lora.use(slot_ids):
            logits = self.model(input_ids=input_ids, attention_mask=attention).logits
            logprobs = _logprobs(logits, targets, temps)
            del logits
            terms: list[Tensor] = []
            groups: dict[LossParams, list[int]] = defaultdict(list)
            for slot in mb.slot_ids_B.unique().tolist():
                groups[states[slot].loss_params].append(slot)
            for params, group in groups.items():
                rows = torch.isin(slot_ids, torch.tensor(group, device=dev))
                ref = (
                    ref_logprobs[rows] if ref_logprobs is not None and params.kl_coef > 0 else None
                )
                loss_BT, token_stats = token_loss(
                    logprobs[rows],
                    old_logprobs[rows],
                    advantages[rows],
                    loss_mask[rows],
                    params,
                    ref,
                )
                _, per_run = per_run_loss(loss_BT, loss_mask[rows], slot_ids[rows], tokens_per_run)
                stats = run_stats(token_stats, loss_mask[rows], slot_ids[rows])
                for slot, run_loss in per_run.items():
                    i = row_of[slot]
                    value = run_loss.detach().to(torch.float64)
                    extras[i, _LOSS] += value
                    if bool(torch.isfinite(value)):
                        terms.append(run_loss)
                    else:
                        extras[i, _BAD] += 1.0
                    s = stats[slot]
                    extras[i, _TOKENS] += s.num_tokens
                    extras[i, _CLIPPED] += s.num_clipped
                    extras[i, _RATIO] += s.ratio_sum
                    extras[i, _KL] += s.kl_sum
                    ratio_max[i] = max(float(ratio_max[i]), s.ratio_max)
            total = torch.stack(terms).sum() if terms else None
            if total is not None and total.requires_grad:
                total.backward()
            elif self.ranks.lockstep:
                _zero_backward(logprobs)

    def _idle_pass(self, mb: MicroBatch, *, reference: bool) -> None:
        """A forward and backward that changes no gradient (its loss is zero): what a rank with
        fewer micro-batches than the others runs so that the sharded model's gathers and
        reductions meet on every rank. One row of a micro-batch of the step, under its slot."""
        input_ids = mb.input_ids_BT[:1].to(self.device)
        attention = mb.attention_mask_BT[:1].to(self.device)
        if reference:
            self._reference_forward(input_ids, attention)
        with self.lora.use(mb.slot_ids_B[:1].to(self.device)):
            logits = self.model(input_ids=input_ids, attention_mask=attention).logits
            _zero_backward(logits)

    def _reference_forward(self, input_ids: Tensor, attention: Tensor) -> None:
        """A base-model forward whose result is not needed, to keep a sharded step in step."""
        with torch.no_grad(), self.lora.use(torch.full((len(input_ids),), NO_ADAPTER)):
            self.model(input_ids=input_ids, attention_mask=attention)

    # --- the per-run update ------------------------------------------------------------------

    def _update(
        self, state: RunState, batch: RolloutBatch, loss: float, bad_loss: bool, stats: RunLossStats
    ) -> RunResult:
        params = self.lora.slot_parameters(state.idx)
        if bad_loss:
            _drop_grads(params)
            return _refused(
                state.idx,
                batch,
                f"non-finite loss ({loss}) at step {batch.step}: the batch's advantages or "
                "log-probabilities drive the policy loss out of float range; step not applied",
            )
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, state.config.optim.max_grad_norm))
        if not math.isfinite(grad_norm):
            _drop_grads(params)
            return _refused(
                state.idx,
                batch,
                f"non-finite gradient (norm {grad_norm}) at step {batch.step} with a finite loss "
                f"({loss:.6g}); step not applied",
            )
        lr = float(state.scheduler.get_last_lr()[0])
        state.optimizer.step()
        state.scheduler.step()
        _drop_grads(params)
        return RunResult(
            slot=state.idx,
            run_id=batch.run_id,
            step=batch.step,
            trained=True,
            loss=loss,
            num_tokens=_num_tokens(batch),
            num_samples=len(batch.samples),
            grad_norm=grad_norm,
            lr=lr,
            reward_mean=_reward_mean(batch),
            stats=stats,
        )


def _denominators(
    tokens_per_run: Mapping[int, int],
    batches: Mapping[int, RolloutBatch],
    states: Mapping[int, RunState],
) -> dict[int, int]:
    """What each run's summed token losses are divided by: its completion tokens in the step,
    or with ``loss.normalize = "constant"`` (Dr. GRPO, Liu et al. 2025, "Understanding
    R1-Zero-Like Training") its samples times ``sampling.max_tokens``, the same for every step,
    so a long completion's tokens weigh as much as a short one's."""
    out = dict(tokens_per_run)
    for slot in out:
        config = states[slot].config
        if config.loss.normalize == "constant":
            out[slot] = len(batches[slot].samples) * config.sampling.max_tokens
    return out


def _rows_by_slot(mb: MicroBatch) -> MicroBatch:
    """The micro-batch with its rows grouped by slot (stable). Rows are independent, so the
    order changes no result, but the adapter layers then find each slot's tokens contiguous
    and skip the gather and scatter of a mixed order (about 7% of a step on CPU)."""
    order = torch.argsort(mb.slot_ids_B, stable=True)
    if bool((order == torch.arange(len(order))).all()):
        return mb
    rows = order.tolist()
    return dataclasses.replace(
        mb,
        input_ids_BT=mb.input_ids_BT[order],
        target_ids_BT=mb.target_ids_BT[order],
        attention_mask_BT=mb.attention_mask_BT[order],
        loss_mask_BT=mb.loss_mask_BT[order],
        old_logprobs_BT=mb.old_logprobs_BT[order],
        advantages_B=mb.advantages_B[order],
        slot_ids_B=mb.slot_ids_B[order],
        sample_run=[mb.sample_run[i] for i in rows],
        sample_index=[mb.sample_index[i] for i in rows],
    )


def _logprobs(logits_BTV: Tensor, target_ids_BT: Tensor, temps_B: Tensor) -> Tensor:
    """Log-probabilities at each row's temperature (one division only when runs differ)."""
    first = float(temps_B[0])
    if bool((temps_B == first).all()):
        return selected_logprobs(logits_BTV, target_ids_BT, temperature=first)
    scaled = logits_BTV.float() / temps_B.view(-1, 1, 1)
    return selected_logprobs(scaled, target_ids_BT)


def _zero_backward(t: Tensor) -> None:
    """Backward of zero through ``t``'s graph: every sharded layer's gradient reduction runs,
    adding nothing. (A non-finite value's rows would still send NaN to their own slot, whose
    run is refused anyway; the rows are independent, so no other slot sees it.)"""
    (t.float().nan_to_num(0.0, 0.0, 0.0) * 0.0).sum().backward()


def _drop_grads(params: Sequence[torch.nn.Parameter]) -> None:
    for p in params:
        p.grad = None


def _num_tokens(batch: RolloutBatch) -> int:
    return sum(len(s.prompt_ids) + len(s.completion_ids) for s in batch.samples)


def _reward_mean(batch: RolloutBatch) -> float:
    return sum(s.reward for s in batch.samples) / len(batch.samples) if batch.samples else 0.0


def _refused(slot: int, batch: RolloutBatch, reason: str) -> RunResult:
    return RunResult(slot=slot, run_id=batch.run_id, step=batch.step, trained=False, reason=reason)
