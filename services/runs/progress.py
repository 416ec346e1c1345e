"""Per-run training progress in KV bucket ``plexrl-progress`` (key = run id).

The trainer writes a run's :class:`~schemas.records.Progress` after each of its optimizer steps
with :func:`write_progress`; orchestrators, ``plexrl runs`` and dashboards read it with
:func:`read_progress`. The value is plain JSON (``schemas/json/progress.json``), so a client in
any language can read it too.
"""

from __future__ import annotations

import logging
import time

import msgspec

from schemas.codec import decode, encode
from schemas.records import Progress
from schemas.run_id import validate_run_id
from schemas.subjects import KV_PROGRESS
from schemas.tenant import validate_tenant
from services.bus import Bus
from services.bus.limits import durable_write, full_as_error
from services.runs.kv import bucket, read_value

log = logging.getLogger(__name__)

PUT_ATTEMPTS = 20
"""Writes of one progress record tried before giving up (about half a minute of backoff)."""


async def write_progress(bus: Bus, run_id: str, progress: Progress) -> int:
    """Store ``progress`` as ``run_id``'s latest, stamped with the time. Returns the revision.
    Transient failures (the server restarting) are retried with backoff; while the bucket
    (or the server's store) is full the write waits for room.

    ``progress.tenant`` names the run's owner; an illegal name raises
    :class:`~schemas.tenant.InvalidTenant` and writes nothing."""
    validate_run_id(run_id)
    validate_tenant(progress.tenant)
    value = encode(msgspec.structs.replace(progress, updated_at=time.time()))

    async def put() -> int:
        kv = await bucket(bus, KV_PROGRESS)
        where, what = f"KV bucket {KV_PROGRESS}", f"the progress of {run_id}"
        with full_as_error(where=where, setting="kv_max_bytes", what=what):
            return await kv.put(run_id, value)  # the same value written again is harmless

    def retrying(exc: BaseException, attempt: int, _: float) -> None:
        log.warning("progress of %s: write failed (%s), retry %d", run_id, exc, attempt)

    return await durable_write(
        put,
        what=f"progress of {run_id}",
        attempts=PUT_ATTEMPTS,
        first_delay=0.1,
        max_delay=2.0,
        give_up=lambda: bus.nc.is_closed,
        on_retry=retrying,
        outage_wait=bus.outage_wait,
        hint=bus.outage_hint,
        stop=bus.stopping,
        lost=bus.reconnects.lost,
    )


async def read_progress(bus: Bus, run_id: str) -> Progress | None:
    """``run_id``'s latest progress, or None if the trainer has written none (or it was deleted).

    Raises :class:`~schemas.codec.DecodeError` for a value that is not a Progress record.
    While JetStream is unavailable it waits as long as the bus's ``outage_wait`` allows.
    """
    validate_run_id(run_id)
    data = await read_value(bus, KV_PROGRESS, run_id, f"reading the progress of {run_id}")
    return None if data is None else decode(data, Progress)
