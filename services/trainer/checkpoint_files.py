"""A run's saved checkpoints as its tenant sees them: list, read, delete, expire.

The ``checkpoints`` training command (:class:`~schemas.training.CheckpointsRequest`) is answered
here, on rank 0, as soon as it arrives: it only touches the run's directory, never the model,
so it need not wait for a step boundary. The run may be active, evicted or finished (its
directory outlives its slot until it is deleted); its owner is read from the run table, and a
request of another tenant is answered exactly as one for a run that does not exist.

What is listed:

- **state** saves: every complete directory under ``{output_dir}/<run_id>/checkpoints/``
  (named saves and the regular ``step_<n>``), with the adapter's rank and alpha and its files
  (``adapter_config.json``, ``adapter_model.safetensors``: a PEFT adapter), which ``read``
  serves in chunks of at most :data:`~schemas.training.CHUNK_MAX` bytes;
- **sampler** saves: the names and steps ``save_weights`` (kind ``sampler``) recorded in
  ``{output_dir}/<run_id>/sampler_saves.jsonl`` (their weights are the announced WeightsReady).

``expire`` writes ``EXPIRES`` (epoch seconds) into a state checkpoint; an expired checkpoint is
deleted the next time the run's checkpoints are listed or read, and is never served.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from schemas.tenant import DEFAULT_TENANT
from schemas.training import (
    CHUNK_MAX,
    CheckpointFile,
    CheckpointInfo,
    CheckpointsRequest,
    CheckpointsResult,
)
from services.bus import Bus
from services.runs.table import read_record
from services.trainer.checkpoint import MARKER, checkpoints_dir

SAMPLER_SAVES = "sampler_saves.jsonl"
EXPIRES = "EXPIRES"
ADAPTER = "adapter"


class CheckpointFiles:
    """Answers CheckpointsRequest from the run directories under ``output_dir``."""

    def __init__(self, bus: Bus, output_dir: Path) -> None:
        self.bus = bus
        self.output_dir = Path(output_dir)

    async def answer(self, tenant: str, req: CheckpointsRequest) -> CheckpointsResult:
        """The result of ``req`` sent on ``tenant``'s subject (an error result says why)."""
        rec = await read_record(self.bus, req.run_id)
        if rec is None or (tenant != DEFAULT_TENANT and rec.tenant != tenant):
            return self._error(req, f"unknown run {req.run_id}")
        try:
            return await asyncio.to_thread(self._apply, req)
        except (OSError, ValueError) as exc:
            return self._error(req, str(exc))

    @staticmethod
    def _error(req: CheckpointsRequest, error: str) -> CheckpointsResult:
        return CheckpointsResult(request_id=req.request_id, run_id=req.run_id, error=error)

    # --- on a worker thread -------------------------------------------------------------------

    def _apply(self, req: CheckpointsRequest) -> CheckpointsResult:
        done = CheckpointsResult(request_id=req.request_id, run_id=req.run_id)
        if req.op == "list":
            found = list_checkpoints(self.output_dir, req.run_id)
            if req.name:
                found = [c for c in found if c.name == req.name and c.kind == req.kind]
            return CheckpointsResult(
                request_id=req.request_id, run_id=req.run_id, checkpoints=found
            )
        if req.op == "delete" and req.kind == "sampler":
            if not forget_sampler_save(self.output_dir, req.run_id, req.name):
                raise ValueError(f"{req.run_id} has no sampler save named {req.name!r}")
            return done
        path = self._state_dir(req)
        if req.op == "read":
            return CheckpointsResult(
                request_id=req.request_id, run_id=req.run_id, data=_read(path, req)
            )
        if req.op == "delete":
            shutil.rmtree(path)
            return done
        # expire
        if req.ttl_s > 0:
            _write_atomic(path / EXPIRES, f"{time.time() + req.ttl_s:.3f}\n")
        else:
            (path / EXPIRES).unlink(missing_ok=True)
        return done

    def _state_dir(self, req: CheckpointsRequest) -> Path:
        if req.kind != "state":
            raise ValueError(f"{req.op} applies to state checkpoints; sampler saves hold no files")
        path = checkpoints_dir(self.output_dir, req.run_id) / req.name
        if not req.name or req.name.startswith(".") or not (path / MARKER).is_file():
            raise ValueError(f"{req.run_id} has no state checkpoint named {req.name!r}")
        if _expired(path):
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"{req.run_id}'s checkpoint {req.name!r} has expired (deleted)")
        return path


def _read(path: Path, req: CheckpointsRequest) -> bytes:
    names = {f.name for f in (path / ADAPTER).iterdir() if f.is_file()}
    if req.file not in names:
        raise ValueError(
            f"checkpoint {req.name!r} has no adapter file {req.file!r} (it has "
            f"{', '.join(sorted(names))})"
        )
    length = min(req.length or CHUNK_MAX, CHUNK_MAX)
    with open(path / ADAPTER / req.file, "rb") as f:
        f.seek(req.offset)
        return f.read(length)


def _expired(path: Path) -> bool:
    try:
        expires = float((path / EXPIRES).read_text())
    except (OSError, ValueError):
        return False
    return 0 < expires <= time.time()


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def list_checkpoints(output_dir: Path, run_id: str) -> list[CheckpointInfo]:
    """Every unexpired state checkpoint and sampler save of the run, oldest first (expired
    state checkpoints are deleted on the way)."""
    found: list[CheckpointInfo] = []
    parent = checkpoints_dir(output_dir, run_id)
    for path in sorted(parent.iterdir()) if parent.is_dir() else []:
        if path.name.startswith(".") or not (path / MARKER).is_file():
            continue
        if _expired(path):
            shutil.rmtree(path, ignore_errors=True)
            continue
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        files = (
            sorted(f for f in (path / ADAPTER).iterdir() if f.is_file())
            if (path / ADAPTER).is_dir()
            else []
        )
        expires = _expires_at(path)
        found.append(
            CheckpointInfo(
                name=path.name,
                kind="state",
                step=int(meta.get("step", 0)),
                created_at=float(meta.get("written_at", 0.0)),
                size_bytes=sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
                rank=int(meta.get("rank", 0)),
                alpha=float(meta.get("alpha", 0.0)),
                expires_at=expires,
                files=[CheckpointFile(path=f.name, size_bytes=f.stat().st_size) for f in files],
            )
        )
    for save in sampler_saves(output_dir, run_id):
        found.append(
            CheckpointInfo(
                name=save["name"],
                kind="sampler",
                step=int(save["step"]),
                created_at=float(save.get("time", 0.0)),
            )
        )
    return sorted(found, key=lambda c: (c.created_at, c.name))


def _expires_at(path: Path) -> float:
    try:
        return float((path / EXPIRES).read_text())
    except (OSError, ValueError):
        return 0.0


# --- sampler saves ----------------------------------------------------------------------------


def sampler_saves(output_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """The sampler saves recorded for the run, the newest of each name."""
    path = Path(output_dir) / run_id / SAMPLER_SAVES
    if not path.is_file():
        return []
    by_name: dict[str, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            by_name[entry["name"]] = entry
    return list(by_name.values())


def record_sampler_save(output_dir: Path, run_id: str, name: str, step: int) -> None:
    """Append a sampler save (``name`` at ``step``) to the run's list."""
    path = Path(output_dir) / run_id / SAMPLER_SAVES
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"name": name, "step": step, "time": time.time()}, sort_keys=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def forget_sampler_save(output_dir: Path, run_id: str, name: str) -> bool:
    """Drop every record of sampler save ``name``; whether there was one."""
    kept = [s for s in sampler_saves(output_dir, run_id) if s["name"] != name]
    before = sampler_saves(output_dir, run_id)
    if len(kept) == len(before):
        return False
    path = Path(output_dir) / run_id / SAMPLER_SAVES
    _write_atomic(path, "".join(json.dumps(s, sort_keys=True) + "\n" for s in kept))
    return True
