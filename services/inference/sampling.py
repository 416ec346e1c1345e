"""Next-token sampling, one row per sequence, each row with its own temperature, top-p and RNG.

For a row with logits z (one per vocabulary entry), temperature T > 0 and nucleus mass p:

    log q(v) = log_softmax(z / T)(v)                                     if p = 1
    log q(v) = log_softmax(z / T masked to the nucleus N_p)(v)           otherwise

where N_p holds the most probable tokens, in decreasing order of probability, up to and
including the first one at which their cumulative probability reaches p (so N_p is never
empty). The token is drawn from q by inverse-CDF sampling with one uniform number from the
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

from collections.abc import Sequence

import torch

GREEDY = 0.0


def nucleus_logprobs(
    logits_BV: torch.Tensor, temperature_B: torch.Tensor, top_p_B: torch.Tensor
) -> torch.Tensor:
    """log q for every row: temperature-scaled, restricted to the top-p nucleus, renormalised.

    Rows with temperature 0 are scaled by 1 (their log q is only used for the argmax).
    """
    scale_B = torch.where(temperature_B > 0, temperature_B, torch.ones_like(temperature_B))
    logprobs_BV = torch.log_softmax(logits_BV.float() / scale_B.unsqueeze(1), dim=-1)
    needs_nucleus = top_p_B < 1.0
    if not bool(needs_nucleus.any()):
        # Skipping the filter when p = 1 matters: a cumulative sum can round to 1.0 before the
        # last token and would cut a tail that log_softmax keeps.
        return logprobs_BV
    rows = needs_nucleus.nonzero().squeeze(1)
    sub_BV = logprobs_BV.index_select(0, rows)
    sorted_BV, order_BV = torch.sort(sub_BV, dim=-1, descending=True)
    probs_BV = sorted_BV.exp()
    mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
    drop_sorted_BV = mass_before_BV >= top_p_B.index_select(0, rows).unsqueeze(1)
    drop_sorted_BV[:, 0] = False
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(1, order_BV, drop_sorted_BV)
    filtered_BV = torch.log_softmax(sub_BV.masked_fill(drop_BV, float("-inf")), dim=-1)
    return logprobs_BV.index_copy(0, rows, filtered_BV)


def sample_rows(
    logits_BV: torch.Tensor,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-probability under the distribution it was drawn from.

    ``generators[i]`` (a CPU generator; None: torch's global CPU RNG) drives row ``i``. The
    uniform numbers are drawn on the CPU and sent to the logits' device in one copy: one small
    transfer per step instead of one kernel per row, and a seed means the same draws on every
    device. Returns ``(tokens_B, logprobs_B)`` on the logits' device.
    """
    num_rows, vocab = logits_BV.shape
    if not len(temperatures) == len(top_ps) == len(generators) == num_rows:
        raise ValueError(
            f"{num_rows} rows of logits but {len(temperatures)} temperatures, {len(top_ps)} top-p "
            f"values and {len(generators)} generators"
        )
    device = logits_BV.device
    temperature_B = torch.tensor(temperatures, dtype=torch.float32, device=device)
    top_p_B = torch.tensor(top_ps, dtype=torch.float32, device=device)
    logprobs_BV = nucleus_logprobs(logits_BV, temperature_B, top_p_B)
    greedy_B = temperature_B <= GREEDY
    uniforms = [
        float(torch.rand((), generator=gen)) if temp > GREEDY else 0.0
        for temp, gen in zip(temperatures, generators, strict=True)
    ]
    uniform_B = torch.tensor(uniforms, dtype=torch.float32).to(device, non_blocking=True)
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
