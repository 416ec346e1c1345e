"""Per-run training progress in KV bucket ``plexrl-progress`` (key = run id, value = JSON).

The trainer writes a run's progress after each of its optimizer steps with
:func:`write_progress`; ``plexrl runs``, the run mirror and dashboards read it with
:func:`read_progress`. The value is plain JSON, so a client in any language can read it too::

    {"step": 12, "total_tokens": 4096, "total_samples": 768, "updated_at": 1718000000.0}

Unknown fields are ignored when reading, so the trainer may add fields freely.
"""

from __future__ import annotations

import json
import time
import weakref
from dataclasses import asdict, dataclass
from typing import Any

from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from schemas.run_id import validate_run_id
from schemas.subjects import KV_PROGRESS
from services.bus import Bus


@dataclass
class Progress:
    """How far one run's training got."""

    step: int
    """optimizer steps taken (the run's current policy version)"""
    total_tokens: int
    """tokens trained on, summed over every step"""
    total_samples: int
    """samples (completions) trained on, summed over every step"""
    updated_at: float = 0.0
    """wall-clock time of the write (seconds since the epoch); set by :func:`write_progress`"""
    reward_mean: float | None = None
    """mean reward of the last trained batch, when the writer knows it"""

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Progress:
        doc: Any = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError(f"progress is a JSON object, got {type(doc).__name__}")
        reward = doc.get("reward_mean")
        return cls(
            step=int(doc.get("step", 0)),
            total_tokens=int(doc.get("total_tokens", 0)),
            total_samples=int(doc.get("total_samples", 0)),
            updated_at=float(doc.get("updated_at", 0.0)),
            reward_mean=None if reward is None else float(reward),
        )


# One KeyValue handle per connection: looking a bucket up costs a round trip.
_buckets: weakref.WeakKeyDictionary[Bus, KeyValue] = weakref.WeakKeyDictionary()


async def _progress_kv(bus: Bus) -> KeyValue:
    kv = _buckets.get(bus)
    if kv is None:
        kv = await bus.js.key_value(KV_PROGRESS)
        _buckets[bus] = kv
    return kv


async def write_progress(bus: Bus, run_id: str, progress: Progress) -> int:
    """Store ``progress`` as ``run_id``'s latest; stamps ``updated_at``. Returns the revision."""
    validate_run_id(run_id)
    progress.updated_at = time.time()
    kv = await _progress_kv(bus)
    return await kv.put(run_id, progress.to_json())


async def read_progress(bus: Bus, run_id: str) -> Progress | None:
    """``run_id``'s latest progress, or None if the trainer has written none (or it was deleted)."""
    validate_run_id(run_id)
    kv = await _progress_kv(bus)
    try:
        entry = await kv.get(run_id)
    except (KeyNotFoundError, KeyDeletedError):
        return None
    if entry.value is None:
        return None
    return Progress.from_json(entry.value)


async def delete_progress(bus: Bus, run_id: str) -> None:
    """Forget ``run_id``'s progress (a fresh run with a reused id starts from step 0)."""
    validate_run_id(run_id)
    kv = await _progress_kv(bus)
    await kv.delete(run_id)
