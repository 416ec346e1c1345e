"""The gateway's copy of its tenant's run table, kept by following the runs' lifecycle events.

Every request that names a run needs its status and owner. Asking the registry each time (a run
list reads every run's progress) makes each request cost the registry work that grows with the
number of runs, so a :class:`RunTable` follows ``PLEXRL_RUNS`` (the tenant's own view of it
with tenant credentials) from its start with a :class:`~services.bus.follower.Follower`:
``RunDiscovered`` makes a run active, ``RunConfigInvalid``, ``RunEvicted`` and ``RunForgotten``
say it is not. A lookup is answered from that table.

A run the table does not hold as active may be one whose event is still on its way (a model
created a moment ago): then the lookup waits for a registry list begun after it, and its rows
join the table. One list runs at a time, shared by every lookup that missed meanwhile, so a
burst of requests for unknown models costs the registry a list at a time, not one each. Whatever
an event says later wins.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from schemas import subjects as sj
from schemas.events import (
    RunConfigInvalid,
    RunDiscovered,
    RunEvicted,
    RunForgotten,
    RunRow,
    RunStatusName,
)
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.bus.follower import Follower, MessageMeta
from services.runs.table import list_runs

log = logging.getLogger(__name__)

Lifecycle = RunDiscovered | RunConfigInvalid | RunEvicted | RunForgotten
LIFECYCLE_KINDS = frozenset(sj.LIFECYCLE_KINDS)


def _is_lifecycle(subject: str) -> bool:
    return subject.rpartition(".")[2] in LIFECYCLE_KINDS


def row_of(event: Lifecycle, before: RunRow | None, at: float) -> RunRow:
    """The run's row after ``event``, stored on the stream at unix time ``at``."""
    labels = before.labels if before is not None else {}
    if isinstance(event, RunDiscovered):
        found = event.config.get("labels")
        labels = {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}
        return RunRow(
            run_id=event.run_id,
            tenant=event.tenant,
            status="active",
            idx=event.idx,
            config_digest=event.config_digest,
            labels=labels,
            updated_at=at,
        )
    status: RunStatusName
    if isinstance(event, RunConfigInvalid):
        status, detail = "invalid", event.error
    elif isinstance(event, RunEvicted):
        status, detail = "evicted", event.reason
    else:
        status, detail = "forgotten", ""
    return RunRow(
        run_id=event.run_id,
        tenant=event.tenant,
        status=status,
        detail=detail,
        config_digest=before.config_digest if before is not None else "",
        labels=labels,
        updated_at=at,
    )


class RunTable:
    """The runs ``tenant`` may see, from their lifecycle events (see the module docstring)."""

    def __init__(self, bus: Bus, tenant: str) -> None:
        self.bus = bus
        self.tenant = tenant
        self.rows: dict[str, RunRow] = {}
        self.lists = 0
        """registry lists asked for by lookups that missed (for tests and benchmarks)"""
        prefix = sj.RUNS_WILDCARD if tenant == DEFAULT_TENANT else f"plexrl.runs.{tenant}.>"
        self._follower: Follower[Any] = Follower(
            bus, sj.RUNS_STREAM, prefix, Lifecycle, self._on_event, decode_subjects=_is_lifecycle
        )
        self._started: asyncio.Task[None] | None = None
        self._listing: asyncio.Task[None] | None = None
        self._listed_at = 0.0

    def _on_event(self, seq: int, event: Lifecycle, meta: MessageMeta) -> None:
        self.rows[event.run_id] = row_of(event, self.rows.get(event.run_id), meta.time.timestamp())

    async def start(self) -> None:
        """Replay the stream to its end (once; concurrent callers wait for the same replay)."""
        if self._started is None:
            self._started = asyncio.create_task(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        await self._follower.start()
        try:
            await self._follower.wait_until_caught_up(30.0)
        except TimeoutError as exc:
            log.warning("gateway: the run table of %s is still replaying: %s", self.tenant, exc)

    async def stop(self) -> None:
        await self._follower.stop()

    async def row(self, run_id: str) -> RunRow | None:
        """``run_id``'s row; a run not active here is looked up in the registry too."""
        await self.start()
        found = self.rows.get(run_id)
        if found is not None and found.status == "active":
            return found
        await self._list()
        return self.rows.get(run_id)

    async def _list(self) -> None:
        """Wait for a registry list begun after this call; lookups that miss at the same time
        share one, and one runs at a time."""
        asked = time.monotonic()
        while True:
            listing = self._listing
            if listing is None or listing.done():
                self._listed_at = time.monotonic()
                self._listing = listing = asyncio.create_task(self._fetch())
            await asyncio.shield(listing)
            if self._listed_at >= asked:
                return

    async def _fetch(self) -> None:
        self.lists += 1
        for listed in await list_runs(self.bus, self.tenant, timeout=5.0):
            known = self.rows.get(listed.run_id)
            # an event newer than the list's view of the run wins
            if known is None or known.updated_at <= listed.updated_at:
                self.rows[listed.run_id] = listed
