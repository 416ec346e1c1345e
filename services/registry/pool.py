"""The index pool: ``max_runs`` adapter slots, handed to runs lowest-first, oldest waiter first.

The trainer allocates ``max_runs`` LoRA slots once, so a run's index is the only thing that ties
it to its adapter, optimizer and scheduler. The pool guarantees what the rest of the system
relies on: an index belongs to at most one run at a time, a run holds at most one index, and
runs that arrive while every slot is taken wait in arrival order instead of being rejected.

The pool is pure bookkeeping with no I/O. The registry persists every assignment in the KV
bucket before announcing it, and rebuilds the pool from that table with :meth:`claim` and
:meth:`enqueue` after a restart, so a restart changes no index.
"""

from __future__ import annotations

import heapq


class PoolError(RuntimeError):
    """An operation that would break the pool's invariants (a bug, or a corrupt table)."""


class IndexPool:
    """Indices ``0..max_runs-1`` with a bidirectional run_id <-> idx map and a waiting queue."""

    def __init__(self, max_runs: int) -> None:
        if max_runs < 1:
            raise ValueError(f"max_runs must be at least 1, got {max_runs}")
        self.max_runs = max_runs
        # A heap of free indices makes "lowest free" O(log n) for pools of thousands.
        self._free: list[int] = list(range(max_runs))
        self._idx_of: dict[str, int] = {}
        self._run_of: dict[int, str] = {}
        self._waiting: dict[str, int] = {}  # run_id -> order key

    # --- lookups ---------------------------------------------------------------------------

    def idx_of(self, run_id: str) -> int | None:
        return self._idx_of.get(run_id)

    def run_id_of(self, idx: int) -> str | None:
        return self._run_of.get(idx)

    @property
    def assigned(self) -> dict[int, str]:
        """A copy of idx -> run_id for every index in use."""
        return dict(self._run_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def waiting(self) -> list[str]:
        """Waiting run ids, the next to get an index first."""
        return [run_id for _, run_id in sorted((o, r) for r, o in self._waiting.items())]

    def is_waiting(self, run_id: str) -> bool:
        return run_id in self._waiting

    # --- assignment ------------------------------------------------------------------------

    def acquire(self, run_id: str) -> int | None:
        """Give ``run_id`` the lowest free index, or None when the pool is full."""
        if run_id in self._idx_of:
            raise PoolError(f"{run_id} already holds index {self._idx_of[run_id]}")
        if not self._free:
            return None
        idx = heapq.heappop(self._free)
        self._bind(run_id, idx)
        return idx

    def claim(self, run_id: str, idx: int) -> None:
        """Give ``run_id`` exactly ``idx`` (restoring a persisted assignment)."""
        if not 0 <= idx < self.max_runs:
            raise PoolError(f"{run_id} holds index {idx}, outside 0..{self.max_runs - 1}")
        holder = self._run_of.get(idx)
        if holder is not None and holder != run_id:
            raise PoolError(f"index {idx} is held by {holder}, cannot give it to {run_id}")
        if holder == run_id:
            return
        if run_id in self._idx_of:
            raise PoolError(f"{run_id} already holds index {self._idx_of[run_id]}")
        self._free.remove(idx)
        heapq.heapify(self._free)
        self._bind(run_id, idx)

    def release(self, run_id: str) -> int | None:
        """Free the index ``run_id`` holds; returns it, or None if it held none."""
        idx = self._idx_of.pop(run_id, None)
        if idx is None:
            return None
        del self._run_of[idx]
        heapq.heappush(self._free, idx)
        return idx

    def _bind(self, run_id: str, idx: int) -> None:
        self._idx_of[run_id] = idx
        self._run_of[idx] = run_id
        self._waiting.pop(run_id, None)

    # --- the waiting queue -----------------------------------------------------------------

    def enqueue(self, run_id: str, order: int) -> None:
        """Put ``run_id`` in the waiting queue; a smaller ``order`` gets an index sooner.

        Re-enqueueing a waiting run keeps its original place.
        """
        if run_id in self._idx_of:
            raise PoolError(f"{run_id} holds index {self._idx_of[run_id]}; it cannot wait")
        self._waiting.setdefault(run_id, order)

    def dequeue(self, run_id: str) -> bool:
        """Take ``run_id`` out of the waiting queue; False if it was not waiting."""
        return self._waiting.pop(run_id, None) is not None

    def next_assignment(self) -> tuple[str, int] | None:
        """Give the oldest waiting run the lowest free index, if both exist."""
        if not self._waiting or not self._free:
            return None
        _, run_id = min((o, r) for r, o in self._waiting.items())
        idx = self.acquire(run_id)
        assert idx is not None
        return run_id, idx
