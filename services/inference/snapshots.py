"""Snapshots: versions of a run kept in slots of their own, for requests of one exact version.

A run's slot always moves on to its newest version; a sampling client of saved weights
(``run_x@4``) must keep getting version 4. The torch engine's multi-LoRA model therefore has
``max_snapshots`` slots beyond the runs' (indices ``max_runs .. max_runs + max_snapshots -
1``), and this class keeps ``(run, version) -> slot``:

- a version is **pinned** into a snapshot slot from a copy of the run's own slot while that
  slot holds exactly this version (nothing staged over it), or from its announced tensors;
  the copy is staged like any adapter (services/inference/adapters.py), so it lands between
  two decode steps, never under a running sequence;
- each use makes a snapshot the most recently used; pinning a new one when every slot is
  taken drops the least recently used (a sequence still running on it finishes first: the
  staged overwrite waits for its slot to be idle), and a later request for the dropped version
  must pin it again (from the weights store, while it still holds the version) or fails
  saying why;
- a run removed takes its snapshots with it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

import torch

from services.inference.adapters import AdapterBank, SlotState


class Snapshots:
    """The snapshot slots of one torch engine (see the module docstring); event loop only."""

    def __init__(self, bank: AdapterBank, first_slot: int, count: int) -> None:
        self.bank = bank
        self.first_slot = first_slot
        self.count = count
        self._pinned: OrderedDict[tuple[str, int], int] = OrderedDict()
        self.dropped: list[tuple[str, int]] = []
        """snapshots dropped for newer ones, oldest first (for tests and logs)"""

    def slot_of(self, run_id: str, version: int) -> int | None:
        """The slot pinned for ``run_id`` at ``version`` (now the most recently used)."""
        slot = self._pinned.get((run_id, version))
        if slot is not None:
            self._pinned.move_to_end((run_id, version))
        return slot

    async def pin_copy(self, slot: int, run_id: str, version: int) -> int | None:
        """Pin a copy of run slot ``slot`` if it holds exactly ``run_id`` at ``version`` with
        nothing staged over it; None otherwise."""
        held = self.slot_of(run_id, version)
        if held is not None:
            return held
        if self.count == 0 or self.bank.loaded(slot) != SlotState(run_id, version):
            return None
        if self.bank.has_staged(slot):
            return None
        lora = self.bank.lora
        # Read on the event loop, where every staging happens: nothing can be staged over the
        # slot between the check above and this copy, and only a staged target is ever written.
        tensors = lora.slot_state_dict(slot)
        rank, alpha = lora.slot_rank(slot), lora.context.alpha(slot)
        return await self._pin(run_id, version, tensors, rank, alpha)

    async def pin_tensors(
        self, run_id: str, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float
    ) -> int:
        """Pin ``run_id`` at ``version`` from its announced adapter tensors."""
        held = self.slot_of(run_id, version)
        if held is not None:
            return held
        self.bank.check_adapter(tensors, rank)
        return await self._pin(run_id, version, tensors, rank, alpha)

    async def _pin(
        self, run_id: str, version: int, tensors: dict[str, torch.Tensor], rank: int, alpha: float
    ) -> int:
        prepared = await asyncio.to_thread(self.bank.prepare, tensors)
        held = self._pinned.get((run_id, version))  # pinned by another request meanwhile
        if held is not None:
            return held
        taken = set(self._pinned.values())
        free = [s for s in range(self.first_slot, self.first_slot + self.count) if s not in taken]
        if free:
            slot = free[0]
        else:
            oldest, slot = self._pinned.popitem(last=False)
            self.dropped.append(oldest)
        self.bank.stage_snapshot(slot, SlotState(run_id, version), prepared, rank, alpha)
        self._pinned[(run_id, version)] = slot
        return slot

    def forget_run(self, run_id: str) -> None:
        """``run_id`` was removed: its snapshots go (their slots serve nothing until reused)."""
        for key in [k for k in self._pinned if k[0] == run_id]:
            self.bank.forget(self._pinned.pop(key))
