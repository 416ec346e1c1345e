"""Triton kernels of the decode path: multi-LoRA by gather (Punica's BGMV) and paged attention.

Both take static shapes and read every per-row choice (adapter slot, cache blocks, length) from
device memory, so a decode step that launches them can be captured in a CUDA graph and replayed
for any mix of runs and lengths.

- ``lora_shrink`` / ``lora_expand``: for token t of slot s = ``slots[t]`` (-1: no adapter),
  h_t = A_s x_t (``shrink``, [T, R]) then y_t += B_s h_t (``expand``, in place on the base
  output). Every token reads its own slot's matrices; tokens of one run share them through the
  cache, so eight adapters cost about what one does. No sorting, no per-adapter launch: two
  launches per layer whatever the number of runs. (Punica's BGMV; S-LoRA's MBGMV.)
- ``paged_decode_attention``: one query token per row against that row's keys and values, read
  through its block table from the paged cache (vLLM's PagedAttention, one program per row and
  KV head, every query head of the group at once, online softmax over blocks).

The kernels are compiled on first use, so importing this module costs nothing and works without
triton. On a CPU they run only through Triton's interpreter, and only where asked for: see
:func:`usable`.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Any

import torch

CPU_INTERPRETER = False
"""Run the kernels on the CPU through Triton's interpreter (the tests that check them there
set it; nothing in a deployment does: the interpreter is far slower than the torch path)."""


def usable(device: torch.device) -> bool:
    """Whether plexrl runs the kernels on tensors of ``device``: on a GPU when triton is
    installed; on a CPU when :data:`CPU_INTERPRETER` asks for Triton's interpreter, which
    ``TRITON_INTERPRET=1`` must have chosen before triton was first imported (it decides how
    triton builds its own functions; transformers imports triton early)."""
    if device.type == "cuda":
        return _installed()
    return (
        device.type == "cpu"
        and CPU_INTERPRETER
        and os.environ.get("TRITON_INTERPRET") == "1"
        and _installed()
    )


@cache
def _installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@cache
def _kernels() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def shrink(x_ptr, a_ptr, slot_ptr, h_ptr, n_in, stride_x, stride_as, stride_ar, stride_h,
               R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        t = tl.program_id(0)
        s = tl.load(slot_ptr + t)
        valid = s >= 0
        s = tl.maximum(s, 0)
        r = tl.arange(0, R)
        acc = tl.zeros([R], dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < n_in
            xv = tl.load(x_ptr + t * stride_x + k, mask=km, other=0.0).to(tl.float32)
            av = tl.load(
                a_ptr + s * stride_as + r[:, None] * stride_ar + k[None, :],
                mask=km[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(av * xv[None, :], axis=1)
        tl.store(h_ptr + t * stride_h + r, tl.where(valid, acc, 0.0))

    @triton.jit
    def expand(h_ptr, b_ptr, slot_ptr, out_ptr, n_out, stride_h, stride_bs, stride_br, stride_o,
               R: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        t = tl.program_id(0)
        nb = tl.program_id(1)
        s = tl.load(slot_ptr + t)
        valid = s >= 0
        s = tl.maximum(s, 0)
        r = tl.arange(0, R)
        n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        nm = n < n_out
        hv = tl.load(h_ptr + t * stride_h + r)
        bv = tl.load(
            b_ptr + s * stride_bs + r[None, :] * stride_br + n[:, None],
            mask=nm[:, None],
            other=0.0,
        ).to(tl.float32)
        y = tl.where(valid, tl.sum(bv * hv[None, :], axis=1), 0.0)
        o = tl.load(out_ptr + t * stride_o + n, mask=nm, other=0.0)
        tl.store(out_ptr + t * stride_o + n, (o.to(tl.float32) + y).to(o.dtype), mask=nm)

    @triton.jit
    def attention(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, o_ptr, scaling,
                  stride_qt, stride_qh, stride_kslot, stride_kh, stride_tb, stride_ot, stride_oh,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  IEEE: tl.constexpr):  # fmt: skip
        t = tl.program_id(0)
        kh = tl.program_id(1)
        length = tl.load(len_ptr + t)
        g = tl.arange(0, G_PAD)
        gm = g < G
        d = tl.arange(0, D)
        j = tl.arange(0, BS)
        heads = kh * G + g
        q = tl.load(
            q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None]
        )
        m = tl.full([G_PAD], float("-inf"), dtype=tl.float32)
        denom = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, D], dtype=tl.float32)
        for p in range(0, tl.cdiv(length, BS)):
            block = tl.load(table_ptr + t * stride_tb + p).to(tl.int64)
            pm = p * BS + j < length
            rows = (block * BS + j)[:, None] * stride_kslot + kh * stride_kh + d[None, :]
            k = tl.load(k_ptr + rows, mask=pm[:, None], other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(pm[None, :], scores * scaling, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            correction = tl.exp(m - m_new)
            probs = tl.exp(scores - m_new[:, None])
            denom = denom * correction + tl.sum(probs, axis=1)
            v = tl.load(v_ptr + rows, mask=pm[:, None], other=0.0)
            if IEEE:
                pv = tl.dot(probs, v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(probs.to(v.dtype), v)
            acc = acc * correction[:, None] + pv
            m = m_new
        out = acc / tl.maximum(denom, 1e-30)[:, None]
        tl.store(
            o_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(o_ptr.dtype.element_ty),
            mask=gm[:, None],
        )

    return shrink, expand, attention


def lora_shrink(x: torch.Tensor, a_all: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """h [T, R] (float32): row t is ``a_all[slots[t]] @ x[t]``, zero where ``slots[t] < 0``.

    ``x`` [T, in] with unit stride along ``in``; ``a_all`` [n, R, in] contiguous, R a power of 2.
    """
    tokens, n_in = x.shape
    rank = a_all.shape[1]
    h = torch.empty(tokens, rank, device=x.device, dtype=torch.float32)
    if tokens:
        shrink = _kernels()[0]
        block_k = min(256, _next_pow2(n_in))
        shrink[(tokens,)](x, a_all, slots, h, n_in, x.stride(0), a_all.stride(0),
                          a_all.stride(1), h.stride(0), R=rank, BLOCK_K=block_k)  # fmt: skip
    return h


def lora_expand(
    out: torch.Tensor, h: torch.Tensor, b_all: torch.Tensor, slots: torch.Tensor
) -> None:
    """``out[t] += b_all[slots[t]] @ h[t]`` in place, rows with ``slots[t] < 0`` untouched.

    ``out`` [T, out] with unit stride along ``out``; ``b_all`` [n, out, R] contiguous.
    """
    tokens, n_out = out.shape
    if not tokens:
        return
    expand = _kernels()[1]
    block_n = min(128, _next_pow2(n_out))
    grid = (tokens, (n_out + block_n - 1) // block_n)
    expand[grid](h, b_all, slots, out, n_out, h.stride(0), b_all.stride(0), b_all.stride(1),
                 out.stride(0), R=b_all.shape[1], BLOCK_N=block_n)  # fmt: skip


def attention_fits(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> bool:
    """Whether :func:`paged_decode_attention` takes these shapes (powers of two, >= 16, as
    ``tl.dot`` wants)."""
    pow2 = head_dim == _next_pow2(head_dim) and block_size == _next_pow2(block_size)
    return pow2 and head_dim >= 16 and block_size >= 16 and num_heads % num_kv_heads == 0


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scaling: float,
    block_size: int,
) -> torch.Tensor:
    """Attention of one query token per row over its first ``lengths[row]`` cached positions.

    ``q`` [B, Hq, D]; ``k_cache``/``v_cache`` [num_blocks * block_size, Hkv, D]; ``block_tables``
    [B, max_blocks] (int32); ``lengths`` [B]. Returns [B, Hq, D] in ``q``'s dtype.
    """
    batch, num_heads, head_dim = q.shape
    num_kv = k_cache.shape[1]
    group = num_heads // num_kv
    out = torch.empty_like(q)
    if batch:
        attention = _kernels()[2]
        attention[(batch, num_kv)](
            q, k_cache, v_cache, block_tables, lengths, out, float(scaling),
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            block_tables.stride(0), out.stride(0), out.stride(1),
            G=group, G_PAD=max(16, _next_pow2(group)), D=head_dim, BS=block_size,
            IEEE=q.dtype == torch.float32,
        )  # fmt: skip
    return out
