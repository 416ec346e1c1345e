"""Log-probabilities beside the sampled token's: a prompt's own tokens, and the most likely
alternatives at a position.

A prompt ``x_0 .. x_{T-1}`` is scored from the logits its prefill computes anyway: position
``t - 1`` predicts token ``t``, so

    prompt_logprobs[0] = None        (no context)
    prompt_logprobs[t] = log_softmax(z_{t-1})[x_t]      t = 1 .. T-1

at temperature 1 with no top-k or top-p filter: the trainer's forward of the same tokens, so a
caller can compare the two (or compute a KL to a reference) directly. The alternatives at a
position are its ``k`` most probable tokens under the distribution given (most likely first);
tokens a filter removed (log-probability -inf) are left out, so a row may hold fewer than
``k``. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from schemas.events import MAX_TOP_LOGPROBS

TopEntries = list[tuple[int, float]]
"""(token id, log-probability) pairs, most likely first"""

MAX_TOP = MAX_TOP_LOGPROBS


def top_entries(logprobs_BV: torch.Tensor, k: int) -> list[TopEntries]:
    """The ``k`` most likely tokens of every row, without those of probability 0."""
    if k <= 0 or logprobs_BV.shape[0] == 0:
        return [[] for _ in range(logprobs_BV.shape[0])]
    values, ids = logprobs_BV.float().topk(min(k, logprobs_BV.shape[-1]), dim=-1)
    return rows_of(ids.tolist(), values.tolist(), k)


def rows_of(ids: list[list[int]], values: list[list[float]], k: int) -> list[TopEntries]:
    """Top-k rows from lists of ids and log-probabilities (each sorted, most likely first),
    cut to ``k`` and without the -inf entries."""
    return [
        [(int(i), float(v)) for i, v in zip(row_ids[:k], row_values[:k], strict=True) if v > -1e30]
        for row_ids, row_values in zip(ids, values, strict=True)
    ]


def prompt_scores(
    logits_TV: torch.Tensor, prompt_ids: Sequence[int], k: int = 0
) -> tuple[list[float | None], list[TopEntries]]:
    """``(logprobs, top)`` of a prompt of ``T`` tokens from its ``T`` rows of logits (see the
    module docstring); ``top`` is empty without ``k``, else one row per token (the first
    empty)."""
    if logits_TV.shape[0] != len(prompt_ids):
        raise ValueError(f"{logits_TV.shape[0]} rows of logits for {len(prompt_ids)} tokens")
    lp_TV = torch.log_softmax(logits_TV[:-1].float(), dim=-1)
    targets = torch.tensor(list(prompt_ids[1:]), dtype=torch.long, device=lp_TV.device)
    chosen = lp_TV.gather(1, targets.unsqueeze(1)).squeeze(1).tolist() if len(targets) else []
    logprobs: list[float | None] = [None, *(float(v) for v in chosen)]
    top = [[], *top_entries(lp_TV, k)] if k > 0 else []
    return logprobs, top
