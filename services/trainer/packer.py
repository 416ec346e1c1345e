"""Pack the rollout batches of several runs into micro-batches for one trainer step.

Layout of a row (one sample, ``P`` prompt tokens, ``C`` completion tokens, ``L = P + C``)::

    position t        0    1   ...  P-1   P   ...  L-2   L-1   L ... T-1
    input_ids_BT      p0   p1  ...  pP-1  c0  ...  cC-2  cC-1  pad ...
    target_ids_BT     p1   p2  ...  c0    c1  ...  cC-1  pad   pad ...
    loss_mask_BT      0    0   ...  1     1   ...  1     0     0   ...
    old_logprobs_BT   0    0   ...  lp0   lp1 ...  lpC-1 0     0   ...

Causal shift: the logits at position ``t`` predict token ``t + 1``, so every per-token tensor is
indexed by the *predicting* position and ``target_ids_BT[:, t] == input_ids_BT[:, t + 1]``. The
model runs on ``input_ids_BT`` unshifted, ``selected_logprobs(logits_BTV, target_ids_BT)`` gives
``logprobs_BT``, and ``logprobs_BT``, ``old_logprobs_BT`` and ``loss_mask_BT`` line up index for
index: completion token ``i`` is scored at position ``P - 1 + i``. Rows are right-padded with
``pad_id``; with causal attention no real token sees a pad, and ``attention_mask_BT`` marks the
real tokens for models that want it.

Order: each run's samples are sorted longest first, then the runs are interleaved round-robin
(one sample of every run that still has samples per round), and the stream is cut greedily
into micro-batches of at most ``token_budget`` padded tokens (``rows * longest row``). Round
robin is the fair share: every micro-batch is split evenly among the runs that still have
samples, whatever order their batches came in, so a run with few samples is finished in the
first micro-batches instead of waiting behind a large one (run A with 64 samples and run B with
4, eight rows a micro-batch: the first holds B's four and four of A's); sorting within a run puts samples of
similar rank, and so of similar length, next to each other, which is what cuts the padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from schemas.events import RolloutBatch, Sample


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass worth of samples, possibly from several runs."""

    input_ids_BT: Tensor
    """int64: prompt + completion, right-padded with ``pad_id``."""
    target_ids_BT: Tensor
    """int64: ``input_ids_BT`` shifted left by one; ``pad_id`` where nothing is predicted."""
    attention_mask_BT: Tensor
    """int64: 1 on real tokens, 0 on padding."""
    loss_mask_BT: Tensor
    """bool: true where ``target_ids_BT`` is a completion token."""
    old_logprobs_BT: Tensor
    """float32: the sampling policy's log-probability of ``target_ids_BT``; 0 off the mask."""
    advantages_B: Tensor
    """float32: one advantage per row."""
    slot_ids_B: Tensor
    """int64: the run slot (adapter index) of each row."""
    sample_run: list[str]
    """run id of each row."""
    sample_index: list[int]
    """index of each row's sample in its RolloutBatch."""
    num_real_tokens: int
    """prompt + completion tokens, padding excluded."""

    @property
    def num_rows(self) -> int:
        return int(self.input_ids_BT.shape[0])

    @property
    def num_tokens(self) -> int:
        """Padded tokens, ``B * T``: what the budget bounds."""
        return int(self.input_ids_BT.numel())

    @property
    def num_padding(self) -> int:
        return self.num_tokens - self.num_real_tokens


@dataclass(frozen=True)
class PackedStep:
    """The micro-batches of one trainer step and the per-run counts the loss needs."""

    micro_batches: list[MicroBatch]
    tokens_per_run: dict[int, int]
    """slot -> loss (completion) tokens of that run over all micro-batches."""
    samples_per_run: dict[int, int]
    """slot -> samples of that run packed."""
    run_ids: dict[int, str]
    """slot -> run id, for the runs that were packed."""
    rejected: dict[str, str]
    """run id -> why its batch was left out; the trainer evicts these runs."""

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    @property
    def padding_fraction(self) -> float:
        """Padded positions over all positions of all micro-batches (0 when nothing packed)."""
        total = self.num_tokens
        return sum(mb.num_padding for mb in self.micro_batches) / total if total else 0.0


@dataclass(frozen=True)
class _Row:
    slot: int
    run_id: str
    index: int
    sample: Sample

    @property
    def length(self) -> int:
        return len(self.sample.prompt_ids) + len(self.sample.completion_ids)


def pack_step(
    batches: Sequence[tuple[int, RolloutBatch]],
    *,
    token_budget: int,
    pad_id: int,
    vocab_size: int,
) -> PackedStep:
    """Pack ``(slot, batch)`` pairs, at most one batch per run, into micro-batches.

    A run whose batch holds an invalid sample is left out and named in ``rejected`` with the
    reason; the other runs pack as usual. Two batches of one run, or two runs on one slot, are
    a caller bug (the trainer must never mix two steps of a run in one optimizer step) and
    raise ``ValueError``.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id {pad_id} is outside the vocabulary [0, {vocab_size})")
    _check_one_batch_per_run(batches)

    rejected: dict[str, str] = {}
    queues: list[list[_Row]] = []
    tokens_per_run: dict[int, int] = {}
    samples_per_run: dict[int, int] = {}
    run_ids: dict[int, str] = {}
    for slot, batch in batches:
        reason = _invalid_reason(batch, token_budget, vocab_size)
        if reason is not None:
            rejected[batch.run_id] = reason
            continue
        rows = [_Row(slot, batch.run_id, i, s) for i, s in enumerate(batch.samples)]
        queues.append(sorted(rows, key=lambda r: -r.length))
        tokens_per_run[slot] = sum(len(s.completion_ids) for s in batch.samples)
        samples_per_run[slot] = len(batch.samples)
        run_ids[slot] = batch.run_id

    micro_batches = [_build(group, pad_id) for group in _cut(_round_robin(queues), token_budget)]
    return PackedStep(
        micro_batches=micro_batches,
        tokens_per_run=tokens_per_run,
        samples_per_run=samples_per_run,
        run_ids=run_ids,
        rejected=rejected,
    )


def _check_one_batch_per_run(batches: Sequence[tuple[int, RolloutBatch]]) -> None:
    by_run: dict[str, RolloutBatch] = {}
    by_slot: dict[int, RolloutBatch] = {}
    for slot, batch in batches:
        if batch.run_id in by_run:
            raise ValueError(
                f"{batch.run_id} appears twice in one packing (steps {by_run[batch.run_id].step} "
                f"and {batch.step}); a trainer step takes at most one step of each run"
            )
        if slot in by_slot:
            raise ValueError(
                f"slot {slot} is given to both {by_slot[slot].run_id} and {batch.run_id}"
            )
        by_run[batch.run_id] = batch
        by_slot[slot] = batch


def _invalid_reason(batch: RolloutBatch, token_budget: int, vocab_size: int) -> str | None:
    """The first problem in ``batch`` (and how many samples have one), or None if it is usable."""
    where = f"step {batch.step}"
    if not batch.samples:
        return f"{where}: the batch has no samples"
    problems = [
        (i, p)
        for i, s in enumerate(batch.samples)
        if (p := _sample_problem(s, token_budget, vocab_size)) is not None
    ]
    if not problems:
        return None
    i, problem = problems[0]
    more = (
        f" ({len(problems)} of {len(batch.samples)} samples invalid)" if len(problems) > 1 else ""
    )
    return f"{where} sample {i}: {problem}{more}"


def _sample_problem(sample: Sample, token_budget: int, vocab_size: int) -> str | None:
    num_prompt, num_completion = len(sample.prompt_ids), len(sample.completion_ids)
    if len(sample.completion_logprobs) != num_completion:
        return (
            f"{len(sample.completion_logprobs)} completion_logprobs for "
            f"{num_completion} completion_ids (they must have the same length)"
        )
    if num_prompt == 0:
        return "empty prompt_ids (the first completion token must be predicted from a prompt token)"
    for part, ids in (("prompt_ids", sample.prompt_ids), ("completion_ids", sample.completion_ids)):
        if ids and (min(ids) < 0 or max(ids) >= vocab_size):
            pos, bad = next((j, t) for j, t in enumerate(ids) if not 0 <= t < vocab_size)
            return f"{part}[{pos}] = {bad} is outside the vocabulary [0, {vocab_size})"
    if not all(math.isfinite(lp) for lp in sample.completion_logprobs):
        pos, bad_lp = next(
            (j, lp) for j, lp in enumerate(sample.completion_logprobs) if not math.isfinite(lp)
        )
        return f"completion_logprobs[{pos}] = {bad_lp} is not finite"
    if not math.isfinite(sample.advantage):
        return f"advantage {sample.advantage} is not finite"
    if num_prompt + num_completion > token_budget:
        return (
            f"{num_prompt + num_completion} tokens ({num_prompt} prompt + {num_completion} "
            f"completion) exceed the micro-batch token budget {token_budget}"
        )
    return None


def _round_robin(queues: list[list[_Row]]) -> list[_Row]:
    order: list[_Row] = []
    for k in range(max((len(q) for q in queues), default=0)):
        order.extend(q[k] for q in queues if k < len(q))
    return order


def _cut(order: list[_Row], token_budget: int) -> list[list[_Row]]:
    groups: list[list[_Row]] = []
    group: list[_Row] = []
    longest = 0
    for row in order:
        # Validation guarantees a single row fits, so a new group always accepts its first row.
        if group and (len(group) + 1) * max(longest, row.length) > token_budget:
            groups.append(group)
            group, longest = [], 0
        group.append(row)
        longest = max(longest, row.length)
    if group:
        groups.append(group)
    return groups


def _build(rows: list[_Row], pad_id: int) -> MicroBatch:
    num_rows, seq_len = len(rows), max(r.length for r in rows)
    input_ids_BT = torch.full((num_rows, seq_len), pad_id, dtype=torch.long)
    target_ids_BT = torch.full((num_rows, seq_len), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((num_rows, seq_len), dtype=torch.long)
    loss_mask_BT = torch.zeros((num_rows, seq_len), dtype=torch.bool)
    old_logprobs_BT = torch.zeros((num_rows, seq_len), dtype=torch.float32)
    for b, row in enumerate(rows):
        s = row.sample
        ids = torch.tensor(list(s.prompt_ids) + list(s.completion_ids), dtype=torch.long)
        num_prompt, num_completion = len(s.prompt_ids), len(s.completion_ids)
        input_ids_BT[b, : row.length] = ids
        target_ids_BT[b, : row.length - 1] = ids[1:]
        attention_mask_BT[b, : row.length] = 1
        span = slice(num_prompt - 1, num_prompt - 1 + num_completion)
        loss_mask_BT[b, span] = True
        old_logprobs_BT[b, span] = torch.tensor(s.completion_logprobs, dtype=torch.float32)
    return MicroBatch(
        input_ids_BT=input_ids_BT,
        target_ids_BT=target_ids_BT,
        attention_mask_BT=attention_mask_BT,
        loss_mask_BT=loss_mask_BT,
        old_logprobs_BT=old_logprobs_BT,
        advantages_B=torch.tensor([r.sample.advantage for r in rows], dtype=torch.float32),
        slot_ids_B=torch.tensor([r.slot for r in rows], dtype=torch.long),
        sample_run=[r.run_id for r in rows],
        sample_index=[r.index for r in rows],
        num_real_tokens=sum(r.length for r in rows),
    )
