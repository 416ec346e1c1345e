"""The one sampler: batched autoregressive sampling with a KV cache, used by the torch inference
engine (sequences of several runs at once, each through its LoRA slot) and by the warm start's
evaluation (the bare model).

One call generates a static batch of sequences, each with its own prompt, adapter slot, length
limit, temperature, top-p and seed:

1. Prefill. Prompts of different lengths are left-padded to the longest; the attention mask
   hides the padding and position ids count only real tokens (``cumsum(mask) - 1``), so each
   row computes exactly what it would alone. The multi-LoRA layers route every row through its
   own slot (``MultiLoRA.use(slot_ids_B)``; -1 is the base model); without a ``MultiLoRA`` the
   model runs as it is.
2. Decode. Each step feeds the last sampled token of every unfinished row and grows the cache
   (Hugging Face ``DynamicCache``) by one column.
3. A row finishes on an end-of-sequence token (``"stop"``; the token and its log-probability are
   *included* in the completion, so the trainer learns to stop) or after ``max_tokens``
   (``"length"``). Finished rows leave the batch: their cache rows are dropped, so they stop
   costing compute.

Between two decode steps, ``step_hook(busy_slots)`` lets the caller swap adapters of slots no
unfinished row uses (see services/inference/adapters.py).

Each step draws one token per row, each row with its own temperature, top-p and RNG. For a row
with logits z (one per vocabulary entry), temperature T > 0 and nucleus mass p:

    log q(v) = log_softmax(z / T)(v)                                     if p = 1
    log q(v) = log_softmax(z / T masked to the nucleus N_p)(v)           otherwise

where N_p holds the most probable tokens, in decreasing order of probability, up to and
including the first one at which their cumulative probability reaches p (so N_p is never
empty). A row with top-k (k > 0) first keeps its k most probable tokens (ties broken by the
sort), renormalises, and then takes the nucleus of that: vLLM's order. The token is drawn from q by inverse-CDF sampling with one uniform number from the
row's own ``torch.Generator``, and the returned log-probability is log q(token): the
distribution actually sampled from. With p = 1 that is exactly the trainer's
``log_softmax(logits / temperature)``; with p < 1 it is the renormalised nucleus, which the
trainer's importance ratio then sees as a (deliberate) off-policy gap.

Temperature 0 is greedy decoding: the argmax, with log-probability 0, because the distribution
sampled from is a point mass on it. A greedy row draws nothing from its generator.

Because a row's draw depends only on its own logits and its own generator, a sequence gets the
same tokens whatever else shares its batch (up to float rounding of its logits, which can flip
a draw only when the uniform lands within ~1e-7 of a bucket edge).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from services.envs.prompts import end_of_turn_ids
from services.model.lora import MultiLoRA
from services.model.scoring import prompt_scores, top_entries

GREEDY = 0.0


def nucleus_logprobs(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    top_k_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """log q for every row: temperature-scaled, restricted to the top-k tokens (k > 0) and the
    top-p nucleus, renormalised.

    Rows with temperature 0 are scaled by 1 (their log q is only used for the argmax).
    """
    logprobs_BV = _scaled_logprobs(logits_BV, temperature_B)
    needs_filter = top_p_B < 1.0
    if top_k_B is not None:
        needs_filter = needs_filter | (top_k_B > 0)
    if not bool(needs_filter.any()):
        # Skipping the filter when p = 1 matters: a cumulative sum can round to 1.0 before the
        # last token and would cut a tail that log_softmax keeps.
        return logprobs_BV
    rows = needs_filter.nonzero().squeeze(1)
    top_k = None if top_k_B is None else top_k_B.index_select(0, rows)
    filtered_BV = _nucleus(logprobs_BV.index_select(0, rows), top_p_B.index_select(0, rows), top_k)
    return logprobs_BV.index_copy(0, rows, filtered_BV)


def _scaled_logprobs(logits_BV: torch.Tensor, temperature_B: torch.Tensor) -> torch.Tensor:
    scale_B = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B))
    return torch.log_softmax(logits_BV.float() / scale_B.unsqueeze(1), dim=-1)


def _nucleus(
    logprobs_BV: torch.Tensor, top_p_B: torch.Tensor, top_k_B: torch.Tensor | None = None
) -> torch.Tensor:
    sorted_BV, order_BV = torch.sort(logprobs_BV, dim=-1, descending=True)
    probs_BV = sorted_BV.exp()
    if top_k_B is None:
        drop_sorted_BV = torch.zeros_like(sorted_BV, dtype=torch.bool)
    else:
        rank_V = torch.arange(sorted_BV.shape[1], device=sorted_BV.device)
        k_B1 = top_k_B.unsqueeze(1)
        drop_sorted_BV = (k_B1 > 0) & (rank_V.unsqueeze(0) >= k_B1)
        # the nucleus of the top-k tokens renormalised (rows without top-k keep their mass)
        kept_BV = torch.softmax(sorted_BV.masked_fill(drop_sorted_BV, float("-inf")), dim=-1)
        probs_BV = torch.where(k_B1 > 0, kept_BV, probs_BV)
    mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
    nucleus_B1 = (top_p_B < 1.0).unsqueeze(1)
    drop_sorted_BV = drop_sorted_BV | (nucleus_B1 & (mass_before_BV >= top_p_B.unsqueeze(1)))
    drop_sorted_BV[:, 0] = False
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(1, order_BV, drop_sorted_BV)
    return torch.log_softmax(logprobs_BV.masked_fill(drop_BV, float("-inf")), dim=-1)


def sample_with_uniforms(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    uniform_B: torch.Tensor,
    *,
    nucleus: bool,
    top_k_B: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sample_rows` on tensors alone: no host synchronisation, so a captured decode step
    can run it. ``uniform_B`` holds each row's uniform number (drawn from its generator
    beforehand); ``nucleus`` False promises every ``top_p`` is 1 and every ``top_k`` 0 (the
    filter is skipped, as :func:`nucleus_logprobs` skips it), True filters the rows whose
    ``top_p`` is below 1 or whose ``top_k`` is above 0."""
    logprobs_BV = sampled_logprobs(logits_BV, temperature_B, top_p_B, nucleus, top_k_B)
    return _draw(logprobs_BV, temperature_B <= GREEDY, uniform_B)


def sampled_logprobs(
    logits_BV: torch.Tensor,
    temperature_B: torch.Tensor,
    top_p_B: torch.Tensor,
    nucleus: bool,
    top_k_B: torch.Tensor | None = None,
) -> torch.Tensor:
    """log q of every row (:func:`sample_with_uniforms`' distribution), without a host
    synchronisation; :func:`draw` samples from it."""
    logprobs_BV = _scaled_logprobs(logits_BV, temperature_B)
    if nucleus:
        needs_B1 = (top_p_B < 1.0).unsqueeze(1)
        if top_k_B is not None:
            needs_B1 = needs_B1 | (top_k_B > 0).unsqueeze(1)
        logprobs_BV = torch.where(needs_B1, _nucleus(logprobs_BV, top_p_B, top_k_B), logprobs_BV)
    return logprobs_BV


def draw(
    logprobs_BV: torch.Tensor, temperature_B: torch.Tensor, uniform_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logprobs_BV`` (from :func:`sampled_logprobs`) and its log q."""
    return _draw(logprobs_BV, temperature_B <= GREEDY, uniform_B)


def _draw(
    logprobs_BV: torch.Tensor, greedy_B: torch.Tensor, uniform_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = logprobs_BV.shape[1]
    cdf_BV = torch.cumsum(logprobs_BV.exp(), dim=-1)
    # The first index whose cumulative probability exceeds u * total. Tokens outside the nucleus
    # have zero width and can never be that index; the clamp and the fallback below only guard
    # against u * total rounding up to the very last edge.
    target_B = (uniform_B * cdf_BV[:, -1]).unsqueeze(1)
    drawn_B = torch.searchsorted(cdf_BV, target_B, right=True).squeeze(1).clamp(max=vocab - 1)
    argmax_B = logprobs_BV.argmax(dim=-1)
    impossible_B = torch.isinf(logprobs_BV.gather(1, drawn_B.unsqueeze(1)).squeeze(1))
    tokens_B = torch.where(greedy_B | impossible_B, argmax_B, drawn_B)
    chosen_B = logprobs_BV.gather(1, tokens_B.unsqueeze(1)).squeeze(1)
    return tokens_B, torch.where(greedy_B, torch.zeros_like(chosen_B), chosen_B)


def sample_rows(
    logits_BV: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    top_ks: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-probability under the distribution it was drawn from.

    ``generators[i]`` (a CPU generator; None: torch's global CPU RNG) drives row ``i``. The
    uniform numbers are drawn on the CPU and sent to the logits' device in one copy: one small
    transfer per step instead of one kernel per row, and a seed means the same draws on every
    device. Returns ``(tokens_B, logprobs_B)`` on the logits' device.
    """
    num_rows = logits_BV.shape[0]
    if not len(temperatures) == len(top_ps) == len(generators) == num_rows:
        raise ValueError(
            f"{num_rows} rows of logits but {len(temperatures)} temperatures, {len(top_ps)} top-p "
            f"values and {len(generators)} generators"
        )
    device = logits_BV.device
    temperature_B = torch.tensor(temperatures, dtype=torch.float32, device=device)
    top_p_B = torch.tensor(top_ps, dtype=torch.float32, device=device)
    top_k_B = None if top_ks is None else torch.tensor(top_ks, dtype=torch.long, device=device)
    logprobs_BV = nucleus_logprobs(logits_BV, temperature_B, top_p_B, top_k_B)
    uniforms = [
        float(torch.rand((), generator=gen)) if temp > GREEDY else 0.0
        for temp, gen in zip(temperatures, generators, strict=True)
    ]
    uniform_B = torch.tensor(uniforms, dtype=torch.float32).to(device, non_blocking=True)
    return _draw(logprobs_BV, temperature_B <= GREEDY, uniform_B)


def sequence_seed(request_seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one sequence of a request, so each sequence has its own stream.

    SplitMix64 over the three numbers: neighbouring requests, prompts and samples get unrelated
    streams, and the same triple always gives the same seed.
    """
    mask = (1 << 64) - 1
    state = request_seed & mask
    for part in (prompt_index, sample_index):
        z = (state + 0x9E3779B97F4A7C15 * ((part & mask) + 1)) & mask
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
        state = z ^ (z >> 31)
    return state >> 1


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate. ``seed`` None draws a fresh random seed."""

    prompt_ids: Sequence[int]
    slot: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    """sample among the ``top_k`` most likely tokens (0: all)"""
    ignore_eos: bool = False
    """generate ``max_tokens`` tokens, through end-of-sequence tokens"""
    top_logprobs: int = 0
    """the most likely tokens to report at each sampled position (and prompt position, with
    ``score_prompt``)"""
    score_prompt: bool = False
    """score the prompt's own tokens (services/model/scoring.py)"""


@dataclass
class SequenceOutput:
    """Sampled tokens, the log-probability of each under the distribution it came from, and why
    the sequence ended; with the spec's ``top_logprobs``, the most likely tokens at each sampled
    position, and with ``score_prompt`` the prompt's scores (scoring.py)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: Literal["stop", "length"] = "length"
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None


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
def cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by, and names it in its output:
    ``cache`` in current transformers, ``past_key_values`` before (still accepted there, with a
    deprecation warning on every call)."""
    forward = getattr(model, "forward", model)
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def generate_batch(
    model: Any,
    lora: MultiLoRA | None,
    specs: Sequence[SequenceSpec],
    *,
    eos_ids: Collection[int],
    pad_id: int,
    step_hook: StepHook | None = None,
) -> list[SequenceOutput]:
    """Generate every sequence of ``specs`` in one batch; outputs in the order of ``specs``.

    ``lora`` None runs ``model`` without adapter routing (every slot is the bare model).
    """
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
    cache_kw = cache_keyword(model)
    first_step = True
    width = input_ids_BL.shape[1]
    scoring = any(s.score_prompt for s in specs)
    while active:
        if step_hook is not None and not first_step:
            step_hook({specs[i].slot for i in active})
        with lora.use(slot_ids_B) if lora is not None else nullcontext():
            out = model(
                input_ids=input_ids_BL,
                attention_mask=mask_BL,
                position_ids=position_ids_BL,
                use_cache=True,
                logits_to_keep=0 if first_step and scoring else 1,
                **{cache_kw: cache},
            )
        cache = getattr(out, cache_kw)  # the same DynamicCache, grown, for Hugging Face models
        if first_step:
            for i, spec in enumerate(specs):
                if spec.score_prompt:  # left-padded: the prompt is the last len(prompt) rows
                    rows = out.logits[i, width - len(spec.prompt_ids) :]
                    logprobs, top = prompt_scores(rows, spec.prompt_ids, spec.top_logprobs)
                    outputs[i].prompt_logprobs = logprobs
                    outputs[i].prompt_top_logprobs = top if spec.top_logprobs else None
        first_step = False
        logits_BV = out.logits[:, -1, :]
        temperatures = [specs[i].temperature for i in active]
        top_ps = [specs[i].top_p for i in active]
        top_ks = [specs[i].top_k for i in active]
        tokens_B, logprobs_B = sample_rows(
            logits_BV, temperatures, top_ps, [generators[i] for i in active], top_ks
        )
        k = max(specs[i].top_logprobs for i in active)
        tops: list[list[tuple[int, float]]] = [[] for _ in active]
        if k:
            device_t = logits_BV.device
            tops = top_entries(
                nucleus_logprobs(
                    logits_BV,
                    torch.tensor(temperatures, device=device_t),
                    torch.tensor(top_ps, device=device_t),
                    torch.tensor(top_ks, device=device_t),
                ),
                k,
            )
        keep: list[int] = []
        for row, (seq, token, logprob) in enumerate(
            zip(active, tokens_B.tolist(), logprobs_B.tolist(), strict=True)
        ):
            output = outputs[seq]
            output.token_ids.append(token)
            output.logprobs.append(logprob)
            if specs[seq].top_logprobs:
                output.top_logprobs.append(tops[row][: specs[seq].top_logprobs])
            if token in eos and not specs[seq].ignore_eos:
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
    """Every end-of-sequence id the model's generation config or tokenizer names, and the
    chat template's end-of-turn token (a chat model ends its reply there, not on ``<eos>``)."""
    ids: list[int] = []
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list | tuple):
            ids.extend(int(v) for v in value)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    if tokenizer is not None:
        ids.extend(end_of_turn_ids(tokenizer))
    return sorted(set(ids))
