"""Removing runs from the pool: eviction, deletion and forgetting a run whose directory is gone.

A mixin of :class:`~services.registry.service.Registry`; every method runs under its lock.

- **evict**: ``control/evicted.txt`` is written, the index freed and ``RunEvicted`` published;
  the run keeps its directory (its checkpoints) and its id, which is never rediscovered.
- **delete** (an ``EvictRequested`` with ``delete``): a run already evicted or invalid loses its
  directory, is forgotten (``RunForgotten``) and its id is free again. This is how a tenant makes
  room under its ``max_run_dirs`` quota. An active or waiting run is evicted first, by a plain
  eviction: a deletion never races a trainer still writing the run's last checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.records import RunRecord, RunStatus
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.launch.faults import crash_point
from services.registry import discovery as fs
from services.registry.ledger import Ledger
from services.registry.pool import IndexPool
from services.registry.tenancy import evict_refusal

log = logging.getLogger(__name__)

HOLDING: tuple[RunStatus, ...] = ("active", "waiting", "invalid")
"""The statuses in which a run holds its id (and, when active, an index)."""


class Removals:
    """Eviction, deletion and forgetting, for the registry (see the module docstring)."""

    bus: Bus
    ledger: Ledger
    output_dir: Path
    _stamps: dict[str, Any]

    @property
    def pool(self) -> IndexPool:
        return self.ledger.pool

    async def _refuse(self, run_id: str | None, error: str, **context: str) -> None:
        """Refuse a request that changes nothing: a ServiceError on plexrl.errors.<service>.

        A refusal caused by another tenant names no ``run_id``: the owner's clients take a
        registry error about their run as a rejection of it.
        """
        log.warning("registry: %s", error)
        await self.bus.report_error(error, run_id=run_id, **context)

    if TYPE_CHECKING:

        async def _reconcile(
            self, state: fs.RunDirState, submit_seq: int = 0, tenant: str = DEFAULT_TENANT
        ) -> None: ...

    async def _forget(self, rec: RunRecord) -> None:
        self._stamps.pop(rec.run_id, None)
        released = self.pool.release(rec.run_id)
        self.pool.dequeue(rec.run_id)
        log.info("registry: %s forgotten (its directory is gone)", rec.run_id)
        await self.ledger.commit(rec.next("forgotten", released_idx=released))

    async def _mark_evicted(self, rec: RunRecord, reason: str, requested_by: str = "") -> None:
        run_id = rec.run_id
        if not (fs.control_dir(self.output_dir, run_id) / fs.EVICTED).exists():
            await asyncio.to_thread(fs.write_evicted, self.output_dir, run_id, reason)
        crash_point("registry.evicted_txt", run_id)
        released = self.pool.release(run_id)
        self.pool.dequeue(run_id)
        by = f" (requested by {requested_by})" if requested_by else ""
        log.warning("registry: %s evicted%s: %s", run_id, by, reason)
        # The config stays with the record: the run list shows an evicted run's labels (the
        # Tinker API finds a finished session's runs and their checkpoints by them).
        new = rec.next(
            "evicted",
            reason=reason,
            released_idx=released,
            config_digest=rec.config_digest,
            config=rec.config,
        )
        await self.ledger.commit(new)
        await self.ledger.settle()  # the freed index goes to the oldest waiting run

    # --- evict and delete -------------------------------------------------------------------

    async def _evict_locked(self, run_id: str, reason: str, requested_by: str, tenant: str) -> bool:
        rec = self.ledger.get(run_id)
        if rec is None or rec.status == "forgotten":
            # it may have appeared since the last scan
            state = fs.inspect_run_dir(self.output_dir, run_id)
            if state is not None:
                await self._reconcile(state)
                await self.ledger.settle()
                rec = self.ledger.get(run_id)
        if (refusal := evict_refusal(rec, tenant)) is not None:
            by = requested_by or "unknown"
            await self._refuse(None, refusal, run=run_id, tenant=tenant, requested_by=by)
            return False
        if rec is not None and rec.status == "evicted":
            log.info("registry: %s is already evicted; ignoring a second request", run_id)
            return True
        if rec is None or rec.status not in HOLDING:
            await self._refuse(
                run_id,
                f"cannot evict {run_id}: no such run in this registry (output_dir "
                f"{self.output_dir}); check the id with `plexrl runs`",
                requested_by=requested_by or "unknown",
            )
            return False
        await self._mark_evicted(rec, reason or "evicted (no reason given)", requested_by)
        return True

    async def _delete_locked(self, run_id: str, requested_by: str, tenant: str) -> bool:
        """Delete the directory of an evicted or invalid run and forget it (see the module
        docstring); False, with a report, when the run is not ``tenant``'s to delete or is not
        evicted or invalid."""
        rec = self.ledger.get(run_id)
        by = requested_by or "unknown"
        if (refusal := evict_refusal(rec, tenant)) is not None:
            await self._refuse(None, refusal, run=run_id, tenant=tenant, requested_by=by)
            return False
        if rec is None or rec.status not in ("evicted", "invalid"):
            status = "unknown" if rec is None else rec.status
            await self._refuse(
                run_id,
                f"cannot delete {run_id}: it is {status}; only an evicted or invalid run is "
                "deleted (evict it first)",
                requested_by=by,
            )
            return False
        path = fs.run_dir(self.output_dir, run_id)
        if path.is_dir() and not path.is_symlink():
            await asyncio.to_thread(shutil.rmtree, path)
        crash_point("registry.deleted", run_id)
        log.warning("registry: %s deleted (requested by %s)", run_id, by)
        await self._forget(rec)
        return True
