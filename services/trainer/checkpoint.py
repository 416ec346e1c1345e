"""Per-run checkpoints, written atomically, and the step log they commit.

Layout, for a run after ``n`` optimizer steps (its policy version ``n``, next batch step ``n``)::

    {output_dir}/<run_id>/checkpoints/step_<n>/
        adapter/adapter_config.json        # a PEFT adapter directory (PEFT and vLLM load it)
        adapter/adapter_model.safetensors
        optimizer.pt                       # AdamW state dict (torch.save, tensors only)
        scheduler.pt                       # LambdaLR state dict (its step counter)
        progress.json                      # {"step", "total_tokens", "total_samples", ...}
        meta.json                          # run id, config digest, kind, rank/alpha, time
        COMPLETE                           # written last: the checkpoint is whole

A full-weight trainer's checkpoint holds ``model.safetensors`` (every parameter under its
Hugging Face name) where an adapter checkpoint holds ``adapter/``, and says ``"kind": "full"``
in ``meta.json`` (a checkpoint without ``kind`` is an adapter's, as every one before the field
existed), so neither kind is ever loaded as the other.

Everything is written into a hidden sibling directory, each file fsync'd, ``COMPLETE`` last,
then the directory is renamed into place and its parent fsync'd. A reader therefore sees a
step directory only once it is whole, and a crash at any point leaves at worst a hidden
partial directory, which :func:`remove_partials` deletes on the next start.

The step log ``{output_dir}/<run_id>/trainer_steps.jsonl`` gets one line per trained batch step,
appended (and fsync'd) only *after* the checkpoint holding that step committed: the log lists
exactly the steps that are durable. If the trainer dies between the rename and the append, the
next start finds the checkpoint ahead of the log and appends the missing lines marked
``"recovered": true`` (:func:`recover_step_log`), so the log never misses a committed step and
never lists one twice unless it was really trained twice.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from schemas.events import WeightKind
from services.model.full import TensorFiles
from services.model.peft_io import (
    ADAPTER_CONFIG,
    FULL_WEIGHTS_FILE,
    read_peft_dir,
    write_peft_dir,
)

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MARKER = "COMPLETE"
STEP_LOG = "trainer_steps.jsonl"
_PREFIX = "step_"


@dataclass
class Checkpoint:
    """A run's trainer state after ``step`` optimizer steps."""

    step: int
    adapter: Mapping[str, torch.Tensor]
    """the adapter (PEFT key names), or with ``kind`` 'full' the whole model's parameters; a
    loaded full checkpoint reads each tensor from disk when asked for it"""
    rank: int
    alpha: float
    target_modules: list[str]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    progress: dict[str, Any]
    """step, total_tokens, total_samples (ints) and reward_mean (float or None)"""
    meta: dict[str, Any] = field(default_factory=dict)
    kind: WeightKind = "lora"
    fan_in_fan_out: bool = False
    """the adapter's targets store their weight [in, out] (Conv1D), as its adapter_config says"""


def checkpoints_dir(output_dir: Path, run_id: str) -> Path:
    return Path(output_dir) / run_id / CHECKPOINTS


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    try:
        _fsync_file(path)
    except OSError:  # some filesystems cannot fsync a directory; the rename is still atomic
        pass


def _write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def save_checkpoint(
    output_dir: Path, run_id: str, ckpt: Checkpoint, keep: int, *, name: str | None = None
) -> Path:
    """Write ``ckpt`` atomically as ``step_<ckpt.step>``, then keep the newest ``keep``.

    With ``name`` (a training command's named save) it is written as ``name`` instead, beside
    the step checkpoints: never pruned, and not what a restart resumes from.
    """
    parent = checkpoints_dir(output_dir, run_id)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / (name or f"{_PREFIX}{ckpt.step}")
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=parent))
    try:
        if ckpt.kind == "full":
            # From the parameters' own memory (a GPU's tensors are copied to the host), not
            # from a serialised copy of the model.
            save_file(dict(ckpt.adapter), staging / FULL_WEIGHTS_FILE, metadata={"format": "pt"})
        else:
            write_peft_dir(
                staging / "adapter",
                ckpt.adapter,
                ckpt.rank,
                ckpt.alpha,
                ckpt.target_modules,
                fan_in_fan_out=ckpt.fan_in_fan_out,
            )
        torch.save(ckpt.optimizer, staging / "optimizer.pt")
        torch.save(ckpt.scheduler, staging / "scheduler.pt")
        _write_json(staging / "progress.json", ckpt.progress)
        meta = {
            **ckpt.meta,
            "run_id": run_id,
            "step": ckpt.step,
            "kind": ckpt.kind,
            "rank": ckpt.rank,
            "alpha": ckpt.alpha,
            "target_modules": list(ckpt.target_modules),
            "written_at": time.time(),
        }
        _write_json(staging / "meta.json", meta)
        for path in staging.rglob("*"):
            if path.is_file():
                _fsync_file(path)
        (staging / MARKER).write_text(f"{ckpt.step}\n")
        _fsync_file(staging / MARKER)
        _fsync_dir(staging)
        os.chmod(staging, 0o755)
        if final.exists():
            # Only after a crash that left a newer checkpoint unreadable and a step retrained:
            # move the old directory aside so the rename below can take its name.
            os.replace(final, parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(staging, final)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    prune(parent, keep)
    return final


def complete_checkpoints(output_dir: Path, run_id: str) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint of the run, oldest first."""
    return _complete_in(checkpoints_dir(output_dir, run_id))


def _complete_in(parent: Path) -> list[tuple[int, Path]]:
    if not parent.is_dir():
        return []
    found = []
    for path in parent.iterdir():
        step = path.name.removeprefix(_PREFIX)
        if path.name.startswith(_PREFIX) and step.isdigit() and (path / MARKER).is_file():
            found.append((int(step), path))
    return sorted(found)


def prune(parent: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` complete checkpoints and any leftover debris."""
    for entry in parent.iterdir():
        if entry.name.startswith(".") and ".old-" in entry.name:
            shutil.rmtree(entry, ignore_errors=True)
    complete = _complete_in(parent)
    for _, path in complete[: max(0, len(complete) - keep)]:
        shutil.rmtree(path, ignore_errors=True)


def remove_partials(output_dir: Path, run_id: str) -> int:
    """Delete checkpoint directories a crash left half-written; returns how many."""
    parent = checkpoints_dir(output_dir, run_id)
    if not parent.is_dir():
        return 0
    removed = 0
    for entry in parent.iterdir():
        if entry.name.startswith(".") or (
            entry.name.startswith(_PREFIX) and not (entry / MARKER).is_file()
        ):
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
    return removed


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a complete checkpoint directory (raises on anything missing or unreadable)."""
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER})")
    meta = json.loads((path / "meta.json").read_text())
    kind = meta.get("kind", "lora")
    adapter: Mapping[str, torch.Tensor]
    fan_in_fan_out = False
    if kind == "full":
        adapter = TensorFiles([path / FULL_WEIGHTS_FILE])
        rank, alpha = int(meta["rank"]), float(meta["alpha"])
        target_modules: list[str] = []
    elif kind == "lora":
        adapter, rank, alpha, target_modules = read_peft_dir(path / "adapter")
        adapter_config = json.loads((path / "adapter" / ADAPTER_CONFIG).read_text())
        fan_in_fan_out = bool(adapter_config.get("fan_in_fan_out", False))
    else:
        raise ValueError(f"{path / 'meta.json'}: unknown checkpoint kind {kind!r}")
    progress = json.loads((path / "progress.json").read_text())
    return Checkpoint(
        step=int(meta["step"]),
        kind=kind,
        adapter=adapter,
        rank=rank,
        alpha=alpha,
        target_modules=target_modules,
        optimizer=torch.load(path / "optimizer.pt", weights_only=True),
        scheduler=torch.load(path / "scheduler.pt", weights_only=True),
        progress={
            **{k: int(progress[k]) for k in ("step", "total_tokens", "total_samples")},
            "reward_mean": progress.get("reward_mean"),
        },
        meta=meta,
        fan_in_fan_out=fan_in_fan_out,
    )


def latest_checkpoint(output_dir: Path, run_id: str) -> Checkpoint | None:
    """The newest complete checkpoint that loads; older ones are tried if a newer one fails."""
    for step, path in reversed(complete_checkpoints(output_dir, run_id)):
        try:
            return load_checkpoint(path)
        except Exception as exc:  # a damaged checkpoint must not stop the run from resuming
            log.error(
                "trainer: %s: checkpoint step %d is unreadable (%s); trying an older one",
                run_id,
                step,
                exc,
            )
    return None


# --- the step log ---------------------------------------------------------------------------


def step_log_path(output_dir: Path, run_id: str) -> Path:
    return Path(output_dir) / run_id / STEP_LOG


def append_step_log(output_dir: Path, run_id: str, records: Iterable[Mapping[str, Any]]) -> None:
    """Append one JSON line per record and fsync before returning."""
    lines = "".join(json.dumps(dict(r), sort_keys=True) + "\n" for r in records)
    if not lines:
        return
    path = step_log_path(output_dir, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())


def read_step_log(output_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """Every complete line of the run's step log (a torn last line is ignored)."""
    path = step_log_path(output_dir, run_id)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def recover_step_log(output_dir: Path, run_id: str, committed_steps: int) -> list[int]:
    """Append lines for batch steps below ``committed_steps`` that a checkpoint holds but the
    log lacks (a crash between commit and append); returns the steps recovered."""
    logged = {int(r["step"]) for r in read_step_log(output_dir, run_id) if "step" in r}
    top = max(logged, default=-1)
    missing = list(range(top + 1, committed_steps))
    append_step_log(
        output_dir,
        run_id,
        (
            {"run_id": run_id, "step": s, "policy_version": s + 1, "recovered": True}
            for s in missing
        ),
    )
    return missing
