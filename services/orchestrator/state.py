"""Where a run's orchestrator resumes: its checkpoint, the trainer's progress and the stream.

After each published step the orchestrator writes
``{output_dir}/<run_id>/checkpoints/orchestrator.json``::

    {"run_id": "run_x", "next_step": 7, "next_prompt_index": 56, "incarnation": 12, ...}

atomically (a temporary file in the same directory, fsync, rename), so a crash at any point
leaves the previous checkpoint or the new one, never a torn file.

The checkpoint alone is not enough: the process can die after a publish and before the write.
So a restarted orchestrator takes the furthest of three independent witnesses:

- its checkpoint's ``next_step``,
- the trainer's progress (``plexrl-progress``): ``step`` batches trained means steps
  ``0..step-1`` exist,
- the newest RolloutBatch on ``plexrl.rollouts.<run_id>`` (one ``get_last_msg``): step ``s``
  there means the next is ``s + 1``.

A tenant's orchestrator reads no KV bucket: it takes the trainer's progress from the registry's
list service (which joins the table with ``plexrl-progress``). With accounts its account has no
rollouts stream (its batches are stored in the services'), so that witness is missing there and
the message ids make a republished step harmless.

It never republishes a step the stream or the trainer already has, and never skips one, since
each witness only ever records steps that were published. Should two witnesses disagree the
message ids (``<run_id>/step_<n>``) still make a duplicate harmless.

``incarnation`` is the stream sequence of the RunDiscovered that started this life of the run
id: a run id reused after its directory was deleted starts again from step 0, so a checkpoint,
progress or batches from an earlier life are ignored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from datetime import datetime
from pathlib import Path

import msgspec

from schemas.codec import DecodeError, decode
from schemas.events import RolloutBatch
from schemas.records import Progress
from schemas.run_id import validate_run_id
from schemas.subjects import ROLLOUTS_STREAM, tenant_rollouts_subject
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.bus.last import last_message
from services.orchestrator.lifecycle import RegistryListError, acting_tenant, registry_row
from services.runs import progress as kv_progress

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "orchestrator.json"


class CheckpointError(RuntimeError):
    """A checkpoint file that exists but cannot be read; the message says what to do."""


class OrchestratorCheckpoint(msgspec.Struct, frozen=True, kw_only=True):
    """What the orchestrator needs to continue a run: the next step and prompt position."""

    run_id: str
    next_step: int
    next_prompt_index: int
    incarnation: int = 0
    config_digest: str = ""
    updated_at: float = 0.0


def run_dir(output_dir: Path | str, run_id: str) -> Path:
    return Path(output_dir) / validate_run_id(run_id)


def checkpoint_path(output_dir: Path | str, run_id: str) -> Path:
    """``{output_dir}/<run_id>/checkpoints/orchestrator.json``."""
    return run_dir(output_dir, run_id) / "checkpoints" / CHECKPOINT_NAME


def atomic_write(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new bytes, nothing else.

    The temporary file lives in the target's directory because ``os.replace`` is atomic only
    within one file system; the fsync before the rename makes the new bytes durable before the
    name points at them.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    # Make the rename itself durable (where the platform lets a directory be opened).
    with contextlib.suppress(OSError):
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def write_checkpoint(path: Path, checkpoint: OrchestratorCheckpoint) -> None:
    stamped = msgspec.structs.replace(checkpoint, updated_at=time.time())
    atomic_write(path, msgspec.json.format(msgspec.json.encode(stamped), indent=2) + b"\n")


def read_checkpoint(path: Path) -> OrchestratorCheckpoint | None:
    """The checkpoint at ``path``, or None if there is none."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    try:
        checkpoint = msgspec.json.decode(data, type=OrchestratorCheckpoint)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CheckpointError(
            f"{path} is not an orchestrator checkpoint ({exc}); delete it to resume from the "
            "trainer's progress and the rollouts stream"
        ) from None
    if checkpoint.next_step < 0 or checkpoint.next_prompt_index < 0:
        raise CheckpointError(f"{path}: negative step or prompt index; delete it to resume")
    return checkpoint


def resume_step(
    checkpoint_next_step: int | None, trainer_step: int | None, last_stream_step: int | None
) -> int:
    """The first step to build: the furthest the checkpoint, the trainer or the stream got."""
    after_stream = None if last_stream_step is None else last_stream_step + 1
    return max(s for s in (0, checkpoint_next_step, trainer_step, after_stream) if s is not None)


async def read_progress(bus: Bus, run_id: str, *, tenant: str | None = None) -> Progress | None:
    """The trainer's progress of ``run_id``, or None if it has recorded none.

    ``tenant`` defaults to the tenant this process acts for. The default tenant reads KV
    ``plexrl-progress``; another asks the registry's list service, and if no registry answers
    the witness is missing (None, with a warning): the checkpoint and the stream still are.
    """
    tenant = acting_tenant(tenant)
    if tenant == DEFAULT_TENANT:
        return await kv_progress.read_progress(bus, run_id)
    try:
        row = await registry_row(bus, run_id, tenant)
    except RegistryListError as exc:
        log.warning("%s: trainer progress unknown (%s)", run_id, exc)
        return None
    if row is None or row.step is None:
        return None
    return Progress(
        step=row.step,
        total_tokens=row.total_tokens or 0,
        total_samples=row.total_samples or 0,
        updated_at=row.updated_at,
        reward_mean=row.reward_mean,
        tenant=row.tenant,
    )


async def last_published_batch(
    bus: Bus, run_id: str, since: datetime | None = None, *, tenant: str | None = None
) -> tuple[int | None, RolloutBatch | None]:
    """The step of the newest RolloutBatch of ``run_id`` on the stream (None if there is none)
    and the batch (None when it does not decode: the step then comes from its message id).

    A batch stored before ``since`` (the start of this incarnation of the run id) does not count.
    ``tenant`` defaults to the tenant this process acts for.
    """
    tenant = acting_tenant(tenant)
    subject = tenant_rollouts_subject(run_id, tenant)
    stored = await last_message(bus, ROLLOUTS_STREAM, subject)
    if stored is None:
        return None, None
    if since is not None and stored.time is not None and stored.time < since:
        return None, None
    try:
        batch: RolloutBatch = decode(stored.data, RolloutBatch, stored.headers.get("Content-Type"))
    except DecodeError:
        # Not ours to judge: the trainer terminates and reports it. The message id still says
        # which step it claims to be.
        return _step_from_msg_id(stored.headers.get("Nats-Msg-Id", "")), None
    return batch.step, batch


def _step_from_msg_id(msg_id: str) -> int | None:
    _, sep, step = msg_id.rpartition("/step_")
    return int(step) if sep and step.isdigit() else None
