"""The multi-LoRA delta over slot segments as one autograd node (the trainer's path).

For tokens sorted by slot into segments (``offs``: cumulative segment ends), with the used
slots' A_s [R, in] and B_s [out, R] and each token's scale c_t = alpha_s / r_s:

    forward:   h = X A_s^T (per segment)      y = (c * h) B_s^T
    backward:  dH' = G B_s                    dB_s = G_s^T (c * h)_s
               dH = c * dH'                   dA_s = dH_s^T X_s        dX = dH A_s

Six grouped matmuls in all (two forward, four backward). Written out by hand so that a layer
adds one node to the autograd graph instead of seven (two stacks, the scaling, two grouped
matmuls and their bookkeeping): at small per-run batches a multi-LoRA layer's cost is what it
launches and what the autograd engine walks, not its arithmetic. The scale multiplies h
([N, R], the smallest tensor) instead of B. Rows of a gradient need not be contiguous (a
caller's ``out.sum()`` gives stride 0): it is made contiguous once here.
"""

from __future__ import annotations

from typing import Any

import torch


class SegmentLoRA(torch.autograd.Function):
    """``SegmentLoRA.apply(x, offs, scale_rows, *A_slots, *B_slots)`` -> the deltas [N, out]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        offs: torch.Tensor,
        scale_rows: torch.Tensor,
        *weights: torch.Tensor,
    ) -> torch.Tensor:
        count = len(weights) // 2
        a = torch.stack(weights[:count]).to(x.dtype)  # [k, R, in]
        b = torch.stack(weights[count:]).to(x.dtype)  # [k, out, R]
        h = torch._grouped_mm(x, a.transpose(1, 2), offs=offs)
        scaled = h * scale_rows
        ctx.save_for_backward(x, a, b, scaled, offs, scale_rows)
        ctx.weight_dtypes = [w.dtype for w in weights]
        return torch._grouped_mm(scaled, b.transpose(1, 2), offs=offs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, a, b, scaled, offs, scale_rows = ctx.saved_tensors
        grad = grad.contiguous()
        grad_h = torch._grouped_mm(grad, b, offs=offs) * scale_rows
        grad_b = torch._grouped_mm(grad.t(), scaled, offs=offs)  # [k, out, R]
        grad_a = torch._grouped_mm(grad_h.t(), x, offs=offs)  # [k, R, in]
        grad_x = torch._grouped_mm(grad_h, a, offs=offs) if ctx.needs_input_grad[0] else None
        dtypes = ctx.weight_dtypes
        count = len(dtypes) // 2
        grads = [g.to(dt) for g, dt in zip(grad_a.unbind(0), dtypes[:count], strict=True)]
        grads += [g.to(dt) for g, dt in zip(grad_b.unbind(0), dtypes[count:], strict=True)]
        return (grad_x, None, None, *grads)
