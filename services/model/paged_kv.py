"""The paged KV cache: preallocated blocks of key/value rows, handed to sequences and taken back.

Every layer's keys live in one tensor of ``num_blocks * block_size`` rows ([rows, Hkv, D], values
alike), allocated once. A sequence holds a list of blocks (its block table); position p of the
sequence is row ``table[p // block_size] * block_size + p % block_size``. Nothing grows: a new
token's keys are written into their row in place, and a sequence that finishes gives its blocks
back for the next one (vLLM's PagedAttention layout).

Block 0 is never handed out. Rows of a decode batch that hold no sequence point every entry of
their table at it, so a captured decode step can run them without a branch: they write into
block 0 and read from it, and what they compute is thrown away.

:func:`paged_attention_reference` is the plain-torch attention over this layout (CPU, and a GPU
without triton); :mod:`services.model.triton_kernels` has the kernel that reads only the blocks
a row uses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

SCRATCH_BLOCK = 0


class BlockAllocator:
    """Free blocks 1..num_blocks-1 (block 0 is the scratch block), handed out lowest first."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a paged cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise MemoryError(f"{count} KV blocks asked for, {len(self._free)} free")
        taken = [self._free.pop() for _ in range(count)]
        return taken

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(sorted(blocks, reverse=True))


class PagedKVCache:
    """Keys and values of every layer in preallocated blocks (see the module docstring)."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def rows(self, block_tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache row of each ``positions[b]`` of row b ([B] or [B, T]) through its table."""
        pos = positions if positions.dim() == 2 else positions.unsqueeze(1)
        page = (pos // self.block_size).clamp(max=block_tables.shape[1] - 1)
        blocks = block_tables.gather(1, page).to(torch.long)
        rows = blocks * self.block_size + pos % self.block_size
        return rows if positions.dim() == 2 else rows.squeeze(1)

    def write(
        self, layer: int, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store ``keys``/``values`` [N, Hkv, D] at cache rows ``rows`` [N] of ``layer``."""
        self.keys[layer].index_copy_(0, rows, keys.to(self.keys.dtype))
        self.values[layer].index_copy_(0, rows, values.to(self.values.dtype))


def reference_layout(
    block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int, num_pages: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`paged_attention_reference` reads, computed once per step for every layer:
    the cache rows of each row's first ``num_pages`` blocks ([B, L]; all of its table when
    None, the shape a captured step needs) and an additive mask [B, 1, 1, L] (0 up to the row's
    length, -inf past it)."""
    batch = block_tables.shape[0]
    pages = block_tables.shape[1] if num_pages is None else num_pages
    offsets = torch.arange(block_size, device=block_tables.device)
    rows = block_tables[:, :pages].to(torch.long).unsqueeze(2) * block_size + offsets
    rows = rows.reshape(batch, pages * block_size)
    visible = torch.arange(rows.shape[1], device=rows.device) < lengths.unsqueeze(1)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=rows.device)
    bias = bias.masked_fill(~visible, float("-inf"))
    return rows, bias[:, None, None, :]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    bias: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """Attention of one query per row ([B, Hq, D]) over the cache rows ``rows`` [B, L], masked
    by ``bias`` (see :func:`reference_layout`): the gathered keys and values through torch's
    scaled-dot-product attention, as Hugging Face's default attention computes it. Returns
    [B, Hq, D]."""
    keys = k_cache[rows].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[rows].transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        keys,
        values,
        attn_mask=bias.to(q.dtype),
        scale=scaling,
        enable_gqa=q.shape[1] != k_cache.shape[1],
    )
    return out.squeeze(2)
