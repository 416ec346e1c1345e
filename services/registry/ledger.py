"""The registry's state and the write-ahead protocol that makes every change crash-safe.

The ledger holds the run records (mirrored in KV ``plexrl-registry``) and the index pool built
from them; free indices go to waiting runs by fair share across tenants (:mod:`.fair_share`).
A change reaches the world in this order, per run:

1. the KV record (the commit point: it carries the index and the message id it owes);
2. the lifecycle event, published with that ``Nats-Msg-Id`` (the stream drops a second copy);
3. ``last_published`` in KV, so a restart republishes nothing already published.

Files (``orch.toml``, ``config_validation_error.txt``, ``evicted.txt``) are written by the
service *before* step 1: a crash in between leaves a file the next scan turns into the same
change. Several records committed together go through each step as one batch of concurrent
requests, so discovering a thousand runs costs three rounds of writes, not three thousand
sequential round trips.

``PLEXRL_FAULT=registry.<point>[@<run_id>][:<status>]`` (points: ``orch_toml``, ``error_txt``,
``evicted_txt``, ``kv``, ``publish``; ``kv`` and ``publish`` may name the status just written;
see :mod:`services.launch.faults`) makes the process exit with status 137 right after that step,
as SIGKILL would: that is how the tests kill the registry between a write and a publish.
"""

from __future__ import annotations

import asyncio
import logging

from schemas.subjects import KV_REGISTRY
from services.bus import Bus
from services.launch.faults import crash_point
from services.registry.fair_share import MaxRuns, assign
from services.registry.pool import IndexPool, PoolError
from services.registry.table import RunRecord, RunTable

log = logging.getLogger(__name__)

# Releases go out before discoveries, so a mirror sees an index freed before it is reused.
_PUBLISH_ORDER = {"evicted": 0, "forgotten": 0, "invalid": 1, "active": 2}


def _no_limit(tenant: str) -> int | None:
    return None


class RegistryError(RuntimeError):
    """The persisted table cannot be served with these settings; the message says what to do."""


class Ledger:
    """Run records, the index pool, and committing changes to KV and the stream."""

    def __init__(self, bus: Bus, max_runs: int, tenant_max_runs: MaxRuns = _no_limit) -> None:
        self.bus = bus
        self.max_runs = max_runs
        self.tenant_max_runs = tenant_max_runs
        self.pool = IndexPool(max_runs)
        self.records: dict[str, RunRecord] = {}
        self._staged: set[str] = set()  # new waiting runs not yet in KV
        self._table: RunTable | None = None
        # True until the table is loaded, and after a failed write (memory may be ahead of KV)
        self.stale = True

    async def open(self) -> None:
        """Load the table and rebuild the pool from it (publishing nothing).

        Nothing changes unless the whole table was read: a half-built pool could hand an index
        out twice.
        """
        self.stale = True
        table = RunTable(await self.bus.js.key_value(KV_REGISTRY), self.bus)
        records = await table.load()
        pool = IndexPool(self.max_runs)
        for rec in records.values():
            if rec.status == "active" and rec.idx is not None:
                try:
                    pool.claim(rec.run_id, rec.idx)
                except PoolError as exc:
                    raise RegistryError(
                        f"the run table in {KV_REGISTRY} cannot be served: {exc}. Start the "
                        f"registry with --max-runs > {rec.idx}, or delete the record with "
                        f"`nats kv del {KV_REGISTRY} {rec.run_id}`"
                    ) from None
            elif rec.status == "waiting":
                pool.enqueue(rec.run_id, rec.queued_at)
        self._table, self.records, self.pool = table, records, pool
        self._staged.clear()
        self.stale = False

    def get(self, run_id: str) -> RunRecord | None:
        return self.records.get(run_id)

    # --- writing ---------------------------------------------------------------------------

    async def save(self, rec: RunRecord) -> None:
        """Persist ``rec`` (a change that owes no event, or a mark)."""
        assert self._table is not None, "Ledger.open() first"
        self.records[rec.run_id] = rec
        self._staged.discard(rec.run_id)
        await self._table.save(rec)

    async def commit(self, *recs: RunRecord) -> None:
        """Persist ``recs``, then publish the events they owe, then mark them published."""
        if not recs:
            return
        await asyncio.gather(*(self.save(r) for r in recs))
        for r in recs:
            crash_point("registry.kv", r.run_id, r.status)
        await self._publish(list(recs))

    async def _publish(self, recs: list[RunRecord]) -> None:
        owed = [(r, e) for r in recs if (e := r.lifecycle_event()) and e[1] != r.last_published]
        # Concurrent publishes of one batch may land in any order; they never conflict (distinct
        # runs, distinct indices), and a release always goes in an earlier batch than a reuse.
        await asyncio.gather(*(self.bus.publish(s, ev, msg_id=mid) for _, (s, mid, ev) in owed))
        for r, (_, mid, _) in owed:
            crash_point("registry.publish", r.run_id, r.status)
            r.last_published = mid
        await asyncio.gather(*(self.save(r) for r, _ in owed))

    async def flush_owed(self) -> None:
        """Publish every event a crash or a failed publish left owed (releases first)."""
        owed = [r for r in self.records.values() if r.owes_event]
        owed.sort(key=lambda r: (_PUBLISH_ORDER.get(r.status, 3), r.updated_at))
        for rec in owed:
            log.info("registry: publishing the %s event owed for %s", rec.status, rec.run_id)
            await self._publish([rec])

    # --- the waiting queue -----------------------------------------------------------------

    def stage_waiting(self, rec: RunRecord) -> None:
        """Queue a new valid run; :meth:`settle` gives it an index or persists it as waiting."""
        self.records[rec.run_id] = rec
        self.pool.enqueue(rec.run_id, rec.queued_at)
        self._staged.add(rec.run_id)

    async def settle(self) -> None:
        """Give every free index to a waiting run (fair share across tenants, see
        :mod:`.fair_share`), then persist the runs still waiting that KV does not know yet."""
        candidates = [
            r
            for r in self.records.values()
            if r.status == "active" or (r.status == "waiting" and self.pool.is_waiting(r.run_id))
        ]
        assigned: list[RunRecord] = []
        for run_id in assign(candidates, self.pool.num_free, self.tenant_max_runs):
            idx = self.pool.acquire(run_id)
            assert idx is not None, "assign() hands out no more runs than free indices"
            rec = self.records[run_id]
            assigned.append(rec.next("active", idx=idx, **rec.carried()))
            log.info("registry: %s discovered with index %d", run_id, idx)
        await self.commit(*assigned)
        still = [self.records[r] for r in sorted(self._staged) if self.pool.is_waiting(r)]
        self._staged.clear()
        for rec in still:
            if self.pool.num_free:
                why = f"tenant {rec.tenant} holds its max_runs = {self.tenant_max_runs(rec.tenant)}"
            else:
                why = f"all {self.max_runs} taken"
            log.info("registry: %s waits for a free index (%s)", rec.run_id, why)
        await asyncio.gather(*(self.save(r) for r in still))
