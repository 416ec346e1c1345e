"""Multi-LoRA by gather: every token reads its own slot's matrices, with no sorting and no host
synchronisation (the decode path).

A token t of slot s gets ``y_t += B'_s A_s x_t`` where ``B'_s = (alpha_s / r_s) B_s``; slot -1
adds nothing. The slots' matrices are kept stacked per layer, ``A_all`` [n, R', in] and
``B'_all^T`` [n, R', out] with R' the max rank rounded up to a power of two (the kernels' tile;
the extra rows are zero), in the layer's dtype and on its device. They are copies
of the slot Parameters, written by :func:`refresh_slot`, which ``MultiLoRA.reset_slot`` and
``load_slot_state_dict`` call: whoever changes a slot's Parameters any other way (an optimizer)
and then decodes by gather calls it too. Copies at fixed addresses are what a captured decode
step needs: a new adapter is written into them between two replays.

Three implementations compute the same thing: the Triton kernels (triton_kernels.py: one
shrink and one expand launch per layer whatever the number of runs; a GPU, or the interpreter)
and two in torch. With few slots (n R' <= 256) every token goes through every slot and a mask
keeps its own: ``((x A_flat^T) * M) B'_flat`` with ``A_flat`` [n R', in], ``B'_flat``
[n R', out] and M [T, n R'] one where the column belongs to the token's slot (built once per
forward): three operations a layer, which is what a CPU's per-operation overhead wants. With
more, each token's matrices are gathered and multiplied with ``bmm``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.model import triton_kernels

if TYPE_CHECKING:
    from services.model.lora import MultiLoRA, MultiLoRALinear


DENSE_COLUMNS = 256
"""Most slot columns (n R') for which the torch path runs every token through every slot."""


@dataclass
class StackedSlots:
    """One layer's slots, stacked: ``a`` [n, R', in], ``b`` [n, R', out] (B^T scaled by
    alpha / r)."""

    a: torch.Tensor
    b: torch.Tensor


def padded_rank(max_rank: int) -> int:
    return 1 << max(0, (max_rank - 1).bit_length())


def stack_slots(lora: MultiLoRA) -> None:
    """Give every layer of ``lora`` its stacked copies, filled from the slots as they stand."""
    rank = padded_rank(lora.max_rank)
    for layer in lora.layers.values():
        weight: torch.Tensor = layer.base_layer.weight  # type: ignore[assignment]
        layer.stacked = StackedSlots(
            a=torch.zeros(
                layer.n_adapters, rank, layer.in_features, device=weight.device, dtype=weight.dtype
            ),
            b=torch.zeros(
                layer.n_adapters, rank, layer.out_features, device=weight.device, dtype=weight.dtype
            ),
        )
    refresh_slots(lora, range(lora.n_adapters))


@torch.no_grad()
def refresh_slots(lora: MultiLoRA, slots: Iterable[int]) -> None:
    """Copy the Parameters of ``slots`` (and their current scale) into the stacked copies."""
    for idx in slots:
        scale = lora.context.scale(idx)
        for layer in lora.layers.values():
            stacked = layer.stacked
            if stacked is None:
                return
            max_rank = layer.max_rank
            stacked.a[idx, :max_rank].copy_(layer.lora_A[idx])
            stacked.b[idx, :max_rank].copy_(layer.lora_B[idx].T * scale)


def add_gathered(out: torch.Tensor, x: torch.Tensor, layer: MultiLoRALinear) -> torch.Tensor:
    """``out`` (the base layer's output for ``x``) plus every token's slot's LoRA delta.

    The slots are the adapter context's per-token ids (``AdapterContext.gather_slots``), one per
    row of ``x`` flattened to [T, in]. Adds in place when the Triton kernels run.
    """
    stacked = layer.stacked
    context = layer.adapter_context
    slots = context.gather_slots
    assert stacked is not None and slots is not None
    x_rows = x.reshape(-1, layer.in_features)
    out_rows = out.reshape(-1, layer.out_features)
    if triton_kernels.usable(x.device) and x_rows.stride(1) == 1 and out_rows.stride(1) == 1:
        h = triton_kernels.lora_shrink(x_rows, stacked.a, slots)
        triton_kernels.lora_expand(out_rows, h, stacked.b, slots)
        return out
    n, rank = stacked.a.shape[:2]
    if n * rank <= DENSE_COLUMNS:
        mask = context.gather_mask(rank, x.dtype)
        h = torch.mm(x_rows, stacked.a.view(n * rank, -1).T) * mask
        return torch.addmm(out_rows, h, stacked.b.view(n * rank, -1)).view(out.shape)
    return out + gathered_delta(x_rows, stacked, slots).view(out.shape).to(out.dtype)


def slot_mask(slots: torch.Tensor, n: int, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """M [T, n R]: one where column c belongs to token t's slot (c // R == slots[t])."""
    owner = torch.arange(n * rank, device=slots.device) // rank
    return (owner.unsqueeze(0) == slots.unsqueeze(1)).to(dtype)


def gathered_delta(
    x_rows: torch.Tensor, stacked: StackedSlots, slots: torch.Tensor
) -> torch.Tensor:
    """The reference: [T, out] deltas from each token's gathered A and B (zero for slot -1)."""
    valid = (slots >= 0).to(x_rows.dtype).unsqueeze(1)
    index = slots.clamp(min=0)
    h = torch.bmm(stacked.a[index], x_rows.unsqueeze(2)).squeeze(2) * valid
    return torch.bmm(h.unsqueeze(1), stacked.b[index]).squeeze(1)
