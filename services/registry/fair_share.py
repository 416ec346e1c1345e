"""Which waiting runs get the free indices: round-robin across tenants, oldest run first.

When indices are free, each goes in turn to a waiting run chosen like this:

1. the candidates are the tenants with a waiting run that hold fewer indices than their
   ``max_runs`` quota (no quota: no limit beyond the pool);
2. the tenant holding the fewest indices now wins; on a tie, the tenant whose oldest waiting run
   has waited longest (then the smaller name, so the choice never depends on dict order);
3. that tenant's oldest waiting run (``queued_at``, then run id) gets the index.

So one tenant that queues a hundred runs cannot starve another that queues one: the next index
to free goes to the tenant with fewer runs going. With a single tenant this is exactly the
pool's old rule, oldest waiter first.

The decision is a pure function of the run records, so it is tested without NATS; the ledger
applies it (see :meth:`services.registry.ledger.Ledger.settle`).
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

from schemas.records import RunRecord

MaxRuns = Callable[[str], int | None]
"""a tenant's ``max_runs`` quota, or None for no limit of its own"""


def assign(records: Iterable[RunRecord], num_free: int, max_runs: MaxRuns) -> list[str]:
    """The waiting run ids that get the ``num_free`` free indices, in the order they get them.

    ``records`` are the table's records: ``active`` ones count as holding an index, ``waiting``
    ones are the candidates; the other statuses are ignored.
    """
    holding: Counter[str] = Counter()
    queues: defaultdict[str, list[tuple[int, str]]] = defaultdict(list)
    for rec in records:
        if rec.status == "active":
            holding[rec.tenant] += 1
        elif rec.status == "waiting":
            queues[rec.tenant].append((rec.queued_at, rec.run_id))
    for queue in queues.values():
        heapq.heapify(queue)
    chosen: list[str] = []
    while len(chosen) < num_free:
        tenant = pick_tenant(queues, holding, max_runs)
        if tenant is None:
            break
        _, run_id = heapq.heappop(queues[tenant])
        if not queues[tenant]:
            del queues[tenant]
        holding[tenant] += 1
        chosen.append(run_id)
    return chosen


def pick_tenant(
    queues: dict[str, list[tuple[int, str]]], holding: Counter[str], max_runs: MaxRuns
) -> str | None:
    """The tenant whose oldest waiting run gets the next index, or None if no tenant may.

    ``queues`` maps each tenant with waiting runs to a heap of ``(queued_at, run_id)``.
    """
    best: tuple[int, int, str] | None = None
    for tenant, queue in queues.items():
        if not queue:
            continue
        limit = max_runs(tenant)
        if limit is not None and holding[tenant] >= limit:
            continue
        key = (holding[tenant], queue[0][0], tenant)
        if best is None or key < best:
            best = key
    return None if best is None else best[2]
