"""The run table's write side, in KV bucket ``plexrl-registry`` (key = run id, value = JSON).

The table is the registry's write-ahead log. Every state change is written here *before* its
lifecycle event is published, together with the ``Nats-Msg-Id`` that event will carry; after the
publish, ``last_published`` records that id. A registry that restarts (or is killed at any
point) reloads the table, republishes only events whose id is not yet in ``last_published``
(the stream drops the copy if the first try did land), and rebuilds the index pool from the
recorded indices, so no index changes and none is handed out twice.

Writes use optimistic concurrency (``kv.create`` for a new key, ``kv.update`` with the last
revision otherwise): a second registry writing the same bucket fails loudly instead of
silently overwriting. A write the bucket refuses because it is full stored nothing, so it is
tried again until there is room (the registry pauses, saying which limit to raise); any other
failure is raised at once, because a write whose answer was lost may have landed, and the
registry then reloads the table rather than guess. The record type is
:class:`schemas.records.RunRecord`; readers use :mod:`services.runs.table`.
"""

from __future__ import annotations

import time

from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas.codec import encode
from schemas.records import RunRecord
from schemas.subjects import KV_REGISTRY
from services.bus import Bus
from services.bus.limits import full_as_error, wait_while_full
from services.runs.table import read_table


class TableConflict(RuntimeError):
    """The bucket changed under us: another registry instance writes the same table."""


class RunTable:
    """Read and write the run table with optimistic concurrency."""

    def __init__(self, kv: KeyValue, bus: Bus | None = None) -> None:
        self.kv = kv
        self.bus = bus
        """the registry's connection: a write paused by a full bucket ends when it closes for
        good or the registry is asked to stop"""
        self._revisions: dict[str, int] = {}

    async def load(self) -> dict[str, RunRecord]:
        """Every record in the bucket (see :func:`~services.runs.table.read_table`)."""
        return await read_table(self.kv, self._revisions)

    async def save(self, record: RunRecord) -> None:
        """Write ``record``; :class:`TableConflict` if someone else wrote it since we read it.
        While the bucket is full, wait for room (see the module docstring)."""
        record.updated_at = time.time()
        key, data = record.run_id, encode(record)
        last = self._revisions.get(key)

        async def write() -> int:
            with full_as_error(
                where=f"KV bucket {KV_REGISTRY}",
                setting="kv_max_bytes",
                what=f"the record of {key}",
            ):
                if last is None:
                    return await self.kv.create(key, data)
                return await self.kv.update(key, data, last=last)

        try:
            bus = self.bus
            revision = await wait_while_full(
                write,
                what=f"registry: {key}",
                give_up=(lambda: bus.nc.is_closed) if bus else (lambda: False),
                stop=bus.stopping if bus else None,
            )
        except KeyWrongLastSequenceError as exc:
            raise TableConflict(
                f"plexrl-registry: {key} was changed by someone else (expected revision {last}): "
                "is a second registry running against this NATS server? Run exactly one."
            ) from exc
        self._revisions[key] = revision
