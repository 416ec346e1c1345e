"""Batched autoregressive sampling with a KV cache over sequences of several runs at once.

One call generates a static batch of sequences, each with its own prompt, adapter slot, length
limit, temperature, top-p and seed:

1. Prefill. Prompts of different lengths are left-padded to the longest; the attention mask
   hides the padding and position ids count only real tokens (``cumsum(mask) - 1``), so each
   row computes exactly what it would alone. The multi-LoRA layers route every row through its
   own slot (``MultiLoRA.use(slot_ids_B)``; -1 is the base model).
2. Decode. Each step feeds the last sampled token of every unfinished row and grows the cache
   (Hugging Face ``DynamicCache``) by one column.
3. A row finishes on an end-of-sequence token (``"stop"``; the token and its log-probability are
   *included* in the completion, so the trainer learns to stop) or after ``max_tokens``
   (``"length"``). Finished rows leave the batch: their cache rows are dropped, so they stop
   costing compute.

Between two decode steps, ``step_hook(busy_slots)`` lets the caller swap adapters of slots no
unfinished row uses (see adapters.py). Sampling itself is in sampling.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from services.inference.sampling import sample_rows
from services.model.lora import MultiLoRA


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate. ``seed`` None draws a fresh random seed."""

    prompt_ids: Sequence[int]
    slot: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class SequenceOutput:
    """Sampled tokens, the log-probability of each under the distribution it came from, and why
    the sequence ended."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Literal["stop", "length"] = "length"


StepHook = Callable[[Collection[int]], object]


def model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def left_pad(
    prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids_BL, attention_mask_BL, position_ids_BL)`` of left-padded prompts."""
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    input_ids_BL = torch.tensor(ids, dtype=torch.long, device=device)
    mask_BL = torch.tensor(mask, dtype=torch.long, device=device)
    position_ids_BL = (mask_BL.cumsum(dim=1) - 1).clamp(min=0)
    return input_ids_BL, mask_BL, position_ids_BL


@torch.inference_mode()
def generate_batch(
    model: Any,
    lora: MultiLoRA,
    specs: Sequence[SequenceSpec],
    *,
    eos_ids: Collection[int],
    pad_id: int,
    step_hook: StepHook | None = None,
) -> list[SequenceOutput]:
    """Generate every sequence of ``specs`` in one batch; outputs in the order of ``specs``."""
    from transformers import DynamicCache

    if not specs:
        return []
    for spec in specs:
        if not spec.prompt_ids:
            raise ValueError("every prompt needs at least one token (start it with <bos>)")
        if spec.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {spec.max_tokens}")
    device = model_device(model)
    eos = frozenset(int(t) for t in eos_ids)
    outputs = [SequenceOutput() for _ in specs]
    generators = [_generator(spec.seed) for spec in specs]

    # Row r of the current tensors is sequence active[r]; rows are dropped as they finish.
    active = list(range(len(specs)))
    input_ids_BL, mask_BL, position_ids_BL = left_pad([s.prompt_ids for s in specs], pad_id, device)
    next_position_B = torch.tensor([len(s.prompt_ids) for s in specs], device=device)
    slot_ids_B = torch.tensor([s.slot for s in specs], dtype=torch.long, device=device)
    cache = DynamicCache()
    first_step = True
    while active:
        if step_hook is not None and not first_step:
            step_hook({specs[i].slot for i in active})
        with lora.use(slot_ids_B):
            out = model(
                input_ids=input_ids_BL,
                attention_mask=mask_BL,
                position_ids=position_ids_BL,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        first_step = False
        tokens_B, logprobs_B = sample_rows(
            out.logits[:, -1, :],
            [specs[i].temperature for i in active],
            [specs[i].top_p for i in active],
            [generators[i] for i in active],
        )
        keep: list[int] = []
        for row, (seq, token, logprob) in enumerate(
            zip(active, tokens_B.tolist(), logprobs_B.tolist(), strict=True)
        ):
            output = outputs[seq]
            output.token_ids.append(token)
            output.logprobs.append(logprob)
            if token in eos:
                output.finish_reason = "stop"
            elif len(output.token_ids) >= specs[seq].max_tokens:
                output.finish_reason = "length"
            else:
                keep.append(row)
        if not keep:
            break
        if len(keep) < len(active):
            rows = torch.tensor(keep, device=device)
            cache.batch_select_indices(rows)
            mask_BL = mask_BL.index_select(0, rows)
            tokens_B = tokens_B.index_select(0, rows)
            next_position_B = next_position_B.index_select(0, rows)
            slot_ids_B = slot_ids_B.index_select(0, rows)
            active = [active[r] for r in keep]
        ones_B1 = torch.ones(len(active), 1, dtype=mask_BL.dtype, device=device)
        mask_BL = torch.cat([mask_BL, ones_B1], dim=1)
        input_ids_BL = tokens_B.unsqueeze(1)
        position_ids_BL = next_position_B.unsqueeze(1)
        next_position_B = next_position_B + 1
    return outputs


def eos_token_ids(model: Any, tokenizer: Any = None) -> list[int]:
    """Every end-of-sequence id the model's generation config or tokenizer names."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list | tuple):
            ids.extend(int(v) for v in value)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))
