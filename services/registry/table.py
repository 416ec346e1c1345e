"""The run table's write side, in KV bucket ``plexrl-registry`` (key = run id, value = JSON).

The table is the registry's write-ahead log. Every state change is written here *before* its
lifecycle event is published, together with the ``Nats-Msg-Id`` that event will carry; after the
publish, ``last_published`` records that id. A registry that restarts (or is killed at any
point) reloads the table, republishes only events whose id is not yet in ``last_published``
(the stream drops the copy if the first try did land), and rebuilds the index pool from the
recorded indices, so no index changes and none is handed out twice.

Writes use optimistic concurrency (``kv.create`` for a new key, ``kv.update`` with the last
revision otherwise): a second registry writing the same bucket fails loudly instead of
silently overwriting. The record type is :class:`schemas.records.RunRecord`; readers use
:mod:`services.runs.table`.
"""

from __future__ import annotations

import time

from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from schemas.codec import encode
from schemas.records import RunRecord
from services.runs.table import read_table


class TableConflict(RuntimeError):
    """The bucket changed under us: another registry instance writes the same table."""


class RunTable:
    """Read and write the run table with optimistic concurrency."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self._revisions: dict[str, int] = {}

    async def load(self) -> dict[str, RunRecord]:
        """Every record in the bucket (see :func:`~services.runs.table.read_table`)."""
        return await read_table(self.kv, self._revisions)

    async def save(self, record: RunRecord) -> None:
        """Write ``record``; :class:`TableConflict` if someone else wrote it since we read it."""
        record.updated_at = time.time()
        key, data = record.run_id, encode(record)
        last = self._revisions.get(key)
        try:
            if last is None:
                revision = await self.kv.create(key, data)
            else:
                revision = await self.kv.update(key, data, last=last)
        except KeyWrongLastSequenceError as exc:
            raise TableConflict(
                f"plexrl-registry: {key} was changed by someone else (expected revision {last}): "
                "is a second registry running against this NATS server? Run exactly one."
            ) from exc
        self._revisions[key] = revision
