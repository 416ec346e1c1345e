"""Who joins the continuous batch next: rollouts first, HTTP sampling in a bounded share.

An RL run's progress must not depend on public traffic, so the torch engine's loop
(continuous.py) keeps the jobs waiting for a place in the batch in two classes:

- **rollouts** (``source = "rollout"``: orchestrators, and every request from before the field)
  in arrival order, admitted first, into any row and KV block that is free;
- **HTTP sampling** (``source = "http"``: the gateway) in one queue per tenant, the tenants taken
  in turn (round-robin), so one tenant's flood cannot starve another's requests. HTTP sequences
  hold at most ``http_share`` of the batch's rows and of its KV blocks at any time, so rollouts
  always find the other ``1 - http_share`` free of HTTP sampling, and a decode step carries at
  most ``http_share x max_num_seqs`` HTTP rows beside them. While HTTP sampling waits, rollouts
  leave free what it lacks of its share: under both loads at once each class gets its part,
  and neither starves the other.

Nothing is preempted: an HTTP sequence already decoding runs to its end (at most its
``max_tokens`` steps), unless its caller cancels it or its deadline passes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Source = str
ROLLOUT: Source = "rollout"
HTTP: Source = "http"


class WaitingJobs:
    """Jobs waiting for the batch: rollouts in arrival order; HTTP sampling per tenant, round
    robin. Items are anything with a ``job`` carrying ``source`` and ``tenant``."""

    def __init__(self) -> None:
        self.rollouts: deque[Any] = deque()
        self.http: dict[str, deque[Any]] = {}
        """per tenant, in the order of their turns (a tenant served goes to the end)"""

    def __len__(self) -> int:
        return len(self.rollouts) + sum(len(q) for q in self.http.values())

    def __iter__(self) -> Iterator[Any]:
        yield from self.rollouts
        for queue in self.http.values():
            yield from queue

    def add(self, item: Any) -> None:
        if item.job.source == HTTP:
            self.http.setdefault(item.job.tenant, deque()).append(item)
        else:
            self.rollouts.append(item)

    def pop(self, source: Source) -> Any | None:
        """The next job of ``source`` (None when none waits); an HTTP tenant served goes to
        the end of the turns."""
        if source != HTTP:
            return self.rollouts.popleft() if self.rollouts else None
        if not self.http:
            return None
        tenant = next(iter(self.http))
        queue = self.http.pop(tenant)
        item = queue.popleft()
        if queue:
            self.http[tenant] = queue
        return item

    def remove(self, unwanted: Callable[[Any], bool]) -> list[Any]:
        """Take out and return every waiting job for which ``unwanted(item)`` holds."""
        gone = [item for item in self if unwanted(item)]
        if gone:
            ids = {id(item) for item in gone}
            self.rollouts = deque(i for i in self.rollouts if id(i) not in ids)
            for tenant in list(self.http):
                kept = deque(i for i in self.http[tenant] if id(i) not in ids)
                if kept:
                    self.http[tenant] = kept
                else:
                    del self.http[tenant]
        return gone


@dataclass(frozen=True)
class HttpShare:
    """The most rows and KV blocks HTTP sampling may hold at once (at least one row, and the
    blocks of one sequence however many that needs)."""

    rows: int
    blocks: int

    @classmethod
    def of(cls, share: float, max_rows: int, num_blocks: int) -> HttpShare:
        return cls(
            rows=max(1, math.floor(share * max_rows)),
            blocks=max(1, math.floor(share * num_blocks)),
        )

    def room(
        self, held_rows: int, held_blocks: int, free_rows: int, free_blocks: int
    ) -> tuple[int, int]:
        """The rows and blocks HTTP sequences may take now, given what they hold and what is
        free. With nothing held, one sequence may take what it needs of the free blocks."""
        rows = min(free_rows, max(0, self.rows - held_rows))
        blocks = free_blocks if held_rows == 0 else min(free_blocks, self.blocks - held_blocks)
        return rows, max(0, blocks)
