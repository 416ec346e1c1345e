"""The read side of the run table, KV bucket ``plexrl-registry`` (key = run id).

The registry writes each run's :class:`~schemas.records.RunRecord` (its write side stays in
:mod:`services.registry.table`); every other service only reads: :func:`read_record` for one
run, :func:`read_table` for all of them. A tenant's credentials cannot read the bucket; a tenant
asks the registry instead, with :func:`list_runs` (``plexrl.registry.<tenant>.list``).
"""

from __future__ import annotations

import asyncio
import logging

from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from schemas.codec import DecodeError, decode
from schemas.events import RunList, RunListRequest, RunRow
from schemas.records import RunRecord
from schemas.subjects import KV_REGISTRY, registry_list_subject
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.runs.kv import read_value

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 30.0
"""how long a read of the table may wait for records the server says are still coming"""


class TableUnreadable(RuntimeError):
    """The table could not be read to its end."""


class RunListFailed(RuntimeError):
    """The registry answered a run list request with an error (the message says why)."""


async def read_record(bus: Bus, run_id: str) -> RunRecord | None:
    """``run_id``'s record, or None if the table has none (DecodeError if unreadable). While
    JetStream is unavailable it waits as long as the bus's ``outage_wait`` allows."""
    what = f"reading the run table's record of {run_id}"
    data = await read_value(bus, KV_REGISTRY, run_id, what)
    return decode(data, RunRecord) if data else None


async def read_table(kv: KeyValue, revisions: dict[str, int] | None = None) -> dict[str, RunRecord]:
    """Every record in the bucket (the latest value per key); unreadable records are skipped.

    ``revisions``, if given, receives each key's revision (the registry writes against them).
    The read ends at the entry the server says is the last one pending, not at nats-py's
    end-of-initial-values marker: that marker can come before entries already on their way
    (the client decides from a consumer-info reply that may overtake them), and a registry
    that restarted on a short read would hand out indices it had already given away.
    """
    records: dict[str, RunRecord] = {}
    revisions = {} if revisions is None else revisions
    status = await kv.status()
    if not status.stream_info.state.messages:
        return records
    watcher = await kv.watchall()
    try:
        async with asyncio.timeout(LOAD_TIMEOUT_S):
            async for entry in watcher:
                if entry is None:  # possibly early: wait for the entry with nothing after it
                    continue
                _apply(records, revisions, entry)
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


async def list_runs(
    bus: Bus,
    tenant: str = DEFAULT_TENANT,
    statuses: tuple[str, ...] = (),
    timeout: float = 5.0,
) -> list[RunRow]:
    """The runs ``tenant`` may see, with their progress, from the registry's list service.

    Raises nats' TimeoutError (or NoRespondersError) when no registry answers, and
    :class:`RunListFailed` when it answers with an error.
    """
    request = RunListRequest(tenant=tenant, statuses=list(statuses))  # type: ignore[arg-type]
    answer = await bus.request(registry_list_subject(tenant), request, RunList, timeout=timeout)
    if answer.error is not None:
        raise RunListFailed(f"the registry could not list the runs: {answer.error}")
    return answer.runs


def _apply(records: dict[str, RunRecord], revisions: dict[str, int], entry: KeyValue.Entry) -> None:
    if entry.operation in (KV_DEL, KV_PURGE) or entry.value is None:
        revisions.pop(entry.key, None)
        records.pop(entry.key, None)
        return
    try:
        record: RunRecord = decode(entry.value, RunRecord)
    except DecodeError as exc:
        log.error("plexrl-registry: skipping unreadable record %s: %s", entry.key, exc)
        return
    records[entry.key] = record
    revisions[entry.key] = entry.revision or 0
