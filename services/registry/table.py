"""The run table, persisted in KV bucket ``plexrl-registry`` (key = run id, value = JSON).

The table is the registry's write-ahead log. Every state change is written here *before* its
lifecycle event is published, together with the ``Nats-Msg-Id`` that event will carry; after the
publish, ``last_published`` records that id. A registry that restarts (or is killed at any
point) reloads the table, republishes only events whose id is not yet in ``last_published``
(the stream drops the copy if the first try did land), and rebuilds the index pool from the
recorded indices, so no index changes and none is handed out twice.

Writes use optimistic concurrency (``kv.create`` for a new key, ``kv.update`` with the last
revision otherwise): a second registry writing the same bucket fails loudly instead of
silently overwriting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

import msgspec
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from schemas import subjects as sj
from schemas.events import Event, RunConfigInvalid, RunDiscovered, RunEvicted, RunForgotten

log = logging.getLogger(__name__)

Status = Literal["waiting", "active", "invalid", "evicted", "forgotten"]
STATUSES: tuple[Status, ...] = ("waiting", "active", "invalid", "evicted", "forgotten")


# how long a read of the table may wait for records the server says are still coming
LOAD_TIMEOUT_S = 30.0


class TableUnreadable(RuntimeError):
    """The table could not be read to its end."""


class TableConflict(RuntimeError):
    """The bucket changed under us: another registry instance writes the same table."""


class RunRecord(msgspec.Struct, kw_only=True):
    """One run as the registry knows it.

    ``transition`` counts state changes of this run id and is part of every lifecycle message
    id, so the eviction of one incarnation of ``run_x`` is never mistaken by the stream's
    deduplication for the eviction of an earlier one. Unknown fields are ignored, so an older
    registry can read a newer table.
    """

    run_id: str
    status: Status
    idx: int | None = None
    config_digest: str = ""
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    file_digest: str = ""
    error: str = ""
    reason: str = ""
    # the index an eviction or disappearance freed: RunEvicted / RunForgotten announce it
    released_idx: int | None = None
    transition: int = 0
    last_published: str = ""
    # waiting runs get an index smallest queued_at first (time.time_ns at first wait)
    queued_at: int = 0
    # stream sequence of the last RunSubmitted applied: a redelivered or replayed submit that
    # is not newer changes nothing
    submit_seq: int = 0
    source: str = ""
    updated_at: float = 0.0

    def lifecycle_event(self) -> tuple[str, str, Event] | None:
        """(subject, Nats-Msg-Id, event) this state owes the stream, or None."""
        rid, n = self.run_id, self.transition
        match self.status:
            case "active" if self.idx is not None:
                short = self.config_digest.removeprefix("sha256:")[:16]
                event: Event = RunDiscovered(
                    run_id=rid, idx=self.idx, config=self.config, config_digest=self.config_digest
                )
                return sj.DISCOVERED, f"{rid}/discovered/{n}/{short}", event
            case "invalid":
                short = self.file_digest.removeprefix("sha256:")[:16]
                event = RunConfigInvalid(run_id=rid, error=self.error[:16000])
                return sj.INVALID, f"{rid}/invalid/{n}/{short}", event
            case "evicted" if self.released_idx is not None:
                event = RunEvicted(run_id=rid, idx=self.released_idx, reason=self.reason[:16000])
                return sj.EVICTED, f"{rid}/evicted/{n}", event
            case "forgotten" if self.released_idx is not None:
                event = RunForgotten(run_id=rid, idx=self.released_idx)
                return sj.FORGOTTEN, f"{rid}/forgotten/{n}", event
        return None

    def next(self, status: Status, **changes: Any) -> RunRecord:
        """The run's next state: a new transition that keeps only what ``changes`` sets and the
        bookkeeping every transition carries over."""
        return RunRecord(
            run_id=self.run_id,
            status=status,
            transition=self.transition + 1,
            last_published=self.last_published,
            submit_seq=max(self.submit_seq, changes.pop("submit_seq", 0)),
            **changes,
        )

    def carried(self) -> dict[str, Any]:
        """What a waiting run keeps when it gets its index."""
        return {
            "config": self.config,
            "config_digest": self.config_digest,
            "file_digest": self.file_digest,
            "queued_at": self.queued_at,
            "source": self.source,
        }

    @property
    def owes_event(self) -> bool:
        owed = self.lifecycle_event()
        return owed is not None and owed[1] != self.last_published


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(RunRecord)


def encode_record(record: RunRecord) -> bytes:
    return _encoder.encode(record)


def decode_record(data: bytes) -> RunRecord:
    return _decoder.decode(data)


class RunTable:
    """Read and write the run table with optimistic concurrency."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self._revisions: dict[str, int] = {}

    async def load(self) -> dict[str, RunRecord]:
        """Every record in the bucket (the latest value per key), remembering revisions.

        The read ends at the entry the server says is the last one pending, not at nats-py's
        end-of-initial-values marker: that marker can come before entries already on their way
        (the client decides from a consumer-info reply that may overtake them), and a registry
        that restarted on a short read would hand out indices it had already given away.
        """
        records: dict[str, RunRecord] = {}
        status = await self.kv.status()
        if not status.stream_info.state.messages:
            return records
        watcher = await self.kv.watchall()
        try:
            async with asyncio.timeout(LOAD_TIMEOUT_S):
                async for entry in watcher:
                    if entry is None:  # possibly early: wait for the entry with nothing after it
                        continue
                    self._apply(records, entry)
                    if entry.delta == 0:
                        break
        except TimeoutError as exc:
            raise TableUnreadable(
                f"plexrl-registry: reading bucket {status.bucket!r} found {len(records)} of its "
                f"records and nothing more came within {LOAD_TIMEOUT_S:.0f}s: is the NATS server "
                "overloaded, or was the bucket's stream purged while it was read?"
            ) from exc
        finally:
            await watcher.stop()
        return records

    def _apply(self, records: dict[str, RunRecord], entry: KeyValue.Entry) -> None:
        if entry.operation in (KV_DEL, KV_PURGE) or entry.value is None:
            self._revisions.pop(entry.key, None)
            records.pop(entry.key, None)
            return
        try:
            record = decode_record(entry.value)
        except msgspec.DecodeError as exc:
            log.error("plexrl-registry: skipping unreadable record %s: %s", entry.key, exc)
            return
        records[entry.key] = record
        self._revisions[entry.key] = entry.revision or 0

    async def save(self, record: RunRecord) -> None:
        """Write ``record``; :class:`TableConflict` if someone else wrote it since we read it."""
        record.updated_at = time.time()
        key, data = record.run_id, encode_record(record)
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


async def read_table(kv: KeyValue) -> dict[str, RunRecord]:
    """A read-only snapshot of the run table (for ``plexrl runs`` and tests)."""
    return await RunTable(kv).load()
