"""Which adapter slot each token uses, shared by every multi-LoRA layer of one model.

An ``AdapterContext`` holds the slot ids of the current batch (one per sequence, or one per
token for packed sequences; -1 means "no adapter") and each slot's rank and alpha. The first
multi-LoRA layer of a forward turns the slot ids into a ``Route``: the adapter tokens sorted by
slot, the slots actually used and their segment ends. Every later layer of the same forward
finds the route in the cache, so tokens are sorted once per model forward, not once per layer.

The cache is keyed by the activations' leading shape and device, and dropped whenever the slot
ids or a slot's rank or alpha change. A forward with a different shape (the decode steps after a
prefill) routes again. Activation checkpointing replays layers during backward, so the slot ids
must stay as they were until the backward has finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

NO_ADAPTER = -1
"""Slot id of a sequence that runs on the base model alone (the KL reference policy)."""


@dataclass(eq=False)
class Route:
    """Adapter tokens of one forward, grouped by slot.

    ``perm`` lists the flat token rows that use an adapter, sorted by slot (stable, so tokens of
    one slot keep their order); None when every token uses an adapter and the tokens are already
    sorted, so layers can skip the gather and the scatter. ``offs`` are the int32 cumulative
    segment ends that ``torch._grouped_mm`` expects, one per used slot.
    """

    perm: torch.Tensor | None
    slots: list[int]
    counts: list[int]
    offs: torch.Tensor
    scales: torch.Tensor
    scale_values: list[float] = field(default_factory=list)
    _padded_rows: torch.Tensor | None = field(default=None, repr=False)
    _scale_rows: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    @property
    def max_count(self) -> int:
        return max(self.counts)

    def scale_rows(self, dtype: torch.dtype) -> torch.Tensor:
        """Each sorted token's slot scale alpha / r, as [N, 1] (built once per route)."""
        if self._scale_rows is None or self._scale_rows.dtype != dtype:
            # Built on the host and sent in one copy, as offs and scales are: no device sync.
            rows = torch.repeat_interleave(
                torch.tensor(self.scale_values), torch.tensor(self.counts)
            )
            device = self.scales.device
            self._scale_rows = rows.to(dtype).unsqueeze(1).to(device, non_blocking=True)
        return self._scale_rows

    def padded_rows(self) -> torch.Tensor:
        """Row of each sorted token in a [num_slots * max_count] padded layout (for bmm)."""
        if self._padded_rows is None:
            device = self.offs.device
            counts = torch.tensor(self.counts, device=device)
            starts = torch.cumsum(counts, 0) - counts
            segment = torch.repeat_interleave(torch.arange(len(self.slots), device=device), counts)
            position = torch.arange(self.num_tokens, device=device) - starts[segment]
            self._padded_rows = segment * self.max_count + position
        return self._padded_rows


class AdapterContext:
    """Slot ids of the current batch and the rank and alpha of every slot."""

    def __init__(self, n_adapters: int, max_rank: int) -> None:
        if n_adapters < 1:
            raise ValueError(f"n_adapters must be at least 1, got {n_adapters}")
        if max_rank < 1:
            raise ValueError(f"max_rank must be at least 1, got {max_rank}")
        self.n_adapters = n_adapters
        self.max_rank = max_rank
        self.kernel = "auto"
        """'auto', 'grouped_mm' or 'bmm': how layers multiply the segments (see lora.py)."""
        self._ranks = [max_rank] * n_adapters
        self._alphas = [float(max_rank)] * n_adapters
        self._slot_ids: torch.Tensor | None = None
        self._cache: tuple[tuple[object, ...], Route | None] | None = None
        self._gather_mask: torch.Tensor | None = None
        self.gather_slots: torch.Tensor | None = None
        """Slot of every token ([T], on the activations' device) while the layers add their
        deltas by gather (lora_gather.py); None: they route by ``slot_ids``."""

    # --- per-slot configuration ----------------------------------------------------------------

    def check_slot(self, idx: int) -> None:
        if not 0 <= idx < self.n_adapters:
            raise IndexError(f"adapter slot {idx} out of range 0..{self.n_adapters - 1}")

    def configure_slot(self, idx: int, rank: int, alpha: float) -> None:
        self.check_slot(idx)
        if not 1 <= rank <= self.max_rank:
            raise ValueError(f"rank {rank} of slot {idx} must be in 1..{self.max_rank} (max_rank)")
        if not alpha > 0:
            raise ValueError(f"alpha of slot {idx} must be positive, got {alpha}")
        self._ranks[idx] = int(rank)
        self._alphas[idx] = float(alpha)
        self._cache = None

    def rank(self, idx: int) -> int:
        self.check_slot(idx)
        return self._ranks[idx]

    def alpha(self, idx: int) -> float:
        self.check_slot(idx)
        return self._alphas[idx]

    def scale(self, idx: int) -> float:
        return self.alpha(idx) / self.rank(idx)

    # --- slot ids of the batch ---------------------------------------------------------------

    @property
    def slot_ids(self) -> torch.Tensor | None:
        return self._slot_ids

    def set_slot_ids(self, slot_ids: torch.Tensor | Sequence[int] | None) -> None:
        """Slot per sequence ([B]) or per token ([B, T]); -1 is the base model, None all base."""
        self._cache = None
        if slot_ids is None:
            self._slot_ids = None
            return
        ids = torch.as_tensor(slot_ids, dtype=torch.long)
        if ids.dim() not in (1, 2) or ids.numel() == 0:
            raise ValueError(
                f"slot ids must be a non-empty [B] or [B, T] tensor, got shape {list(ids.shape)}"
            )
        low, high = int(ids.min()), int(ids.max())
        if low < NO_ADAPTER or high >= self.n_adapters:
            raise ValueError(
                f"slot ids must lie in -1..{self.n_adapters - 1}, got values {low}..{high}"
            )
        self._slot_ids = ids

    def set_gather_slots(self, token_slots: torch.Tensor | None) -> None:
        """Switch the layers to the gather path with this slot per token (trusted: a device
        tensor of ids in -1..n-1, checked by whoever built it, so no host synchronisation), or
        back to routing with None."""
        self.gather_slots = token_slots
        self._gather_mask = None

    def gather_mask(self, rank: int, dtype: torch.dtype) -> torch.Tensor:
        """The gather path's slot mask [T, n * rank] (lora_gather.slot_mask), built once per
        forward and shared by its layers."""
        from services.model.lora_gather import slot_mask

        assert self.gather_slots is not None
        mask = self._gather_mask
        if mask is None or mask.dtype != dtype or mask.shape[1] != self.n_adapters * rank:
            mask = slot_mask(self.gather_slots, self.n_adapters, rank, dtype)
            self._gather_mask = mask
        return mask

    # --- routing -------------------------------------------------------------------------------

    def route(self, x: torch.Tensor) -> Route | None:
        """The route of activations ``x`` [..., features]; None when no token uses an adapter."""
        if self._slot_ids is None:
            return None
        key = (tuple(x.shape[:-1]), x.device)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1]
        route = self._build_route(self._token_slots(x))
        self._cache = (key, route)
        return route

    def _token_slots(self, x: torch.Tensor) -> torch.Tensor:
        assert self._slot_ids is not None
        ids = self._slot_ids.to(x.device, non_blocking=True)
        lead = tuple(x.shape[:-1])
        if tuple(ids.shape) == lead:
            return ids.reshape(-1)
        if ids.dim() == 1 and len(lead) >= 1 and lead[0] == ids.shape[0]:
            per_sequence = ids.view(-1, *([1] * (len(lead) - 1)))
            return per_sequence.expand(lead).reshape(-1)
        raise ValueError(
            f"slot ids of shape {list(ids.shape)} do not match activations of shape "
            f"{list(x.shape)}: give one slot id per sequence ([B]) or per token ([B, T])"
        )

    def _build_route(self, token_slots: torch.Tensor) -> Route | None:
        order = torch.argsort(token_slots, stable=True)
        # Slot -1 lands in bin 0. The sortedness flag rides along so the host reads everything
        # it needs in one device-to-host copy.
        counts = torch.bincount(token_slots + 1, minlength=self.n_adapters + 1)
        is_sorted = (token_slots[1:] >= token_slots[:-1]).all().reshape(1)
        host = torch.cat([counts, is_sorted.long()]).tolist()
        num_base, slot_counts, already_sorted = host[0], host[1:-1], bool(host[-1])
        slots = [s for s, n in enumerate(slot_counts) if n > 0]
        if not slots:
            return None
        counts_used = [slot_counts[s] for s in slots]
        device = token_slots.device
        perm = None if num_base == 0 and already_sorted else order[num_base:]
        offs = torch.tensor(list(itertools.accumulate(counts_used)), dtype=torch.int32)
        values = [self.scale(s) for s in slots]
        scales = torch.tensor(values, dtype=torch.float32)
        return Route(
            perm=perm,
            slots=slots,
            counts=counts_used,
            offs=offs.to(device, non_blocking=True),
            scales=scales.to(device, non_blocking=True),
            scale_values=values,
        )
