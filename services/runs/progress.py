"""Per-run training progress in KV bucket ``plexrl-progress`` (key = run id).

The trainer writes a run's :class:`~schemas.records.Progress` after each of its optimizer steps
with :func:`write_progress`; orchestrators, ``plexrl runs`` and dashboards read it with
:func:`read_progress`. The value is plain JSON (``schemas/json/progress.json``), so a client in
any language can read it too.
"""

from __future__ import annotations

import time

import msgspec
from nats.js.errors import KeyDeletedError, KeyNotFoundError

from schemas.codec import decode, encode
from schemas.records import Progress
from schemas.run_id import validate_run_id
from schemas.subjects import KV_PROGRESS
from schemas.tenant import validate_tenant
from services.bus import Bus
from services.runs.kv import bucket


async def write_progress(bus: Bus, run_id: str, progress: Progress) -> int:
    """Store ``progress`` as ``run_id``'s latest, stamped with the time. Returns the revision.

    ``progress.tenant`` names the run's owner; an illegal name raises
    :class:`~schemas.tenant.InvalidTenant` and writes nothing."""
    validate_run_id(run_id)
    validate_tenant(progress.tenant)
    kv = await bucket(bus, KV_PROGRESS)
    return await kv.put(run_id, encode(msgspec.structs.replace(progress, updated_at=time.time())))


async def read_progress(bus: Bus, run_id: str) -> Progress | None:
    """``run_id``'s latest progress, or None if the trainer has written none (or it was deleted).

    Raises :class:`~schemas.codec.DecodeError` for a value that is not a Progress record.
    """
    validate_run_id(run_id)
    kv = await bucket(bus, KV_PROGRESS)
    try:
        entry = await kv.get(run_id)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    if entry.value is None:
        return None
    return decode(entry.value, Progress)
