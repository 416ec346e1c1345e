"""The filesystem side of the registry: scanning ``{output_dir}/run_*`` and the control files.

A run directory (DESIGN.md, "Run directory") is discovered when it holds
``control/orch.toml`` and no ``control/evicted.txt``. Every path the registry touches is built
here from a run id that passed :func:`schemas.run_id.validate_run_id` and is checked to stay a
real directory directly inside ``output_dir``: a name like ``run_a.b`` or a symbolic link is
reported, never followed, so nothing is ever written outside ``output_dir``.

Writes are atomic (a temporary file in the same directory, fsync, rename): a reader, or a
registry restarted after a crash, sees either the old file or the new one, never half of one.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from schemas.run_id import is_valid_run_id, validate_run_id

CONTROL = "control"
ORCH_TOML = "orch.toml"
VALIDATION_ERROR = "config_validation_error.txt"
EVICTED = "evicted.txt"


@dataclass(frozen=True)
class RunDirState:
    """What one scan saw of one legal run directory."""

    run_id: str
    path: Path
    has_config: bool
    evicted: bool
    # (mtime_ns, size, inode) of orch.toml: an unchanged stamp means the file need not be read
    stamp: tuple[int, int, int] | None


@dataclass
class ScanResult:
    """Every legal run directory, and the run_* names that were skipped and why."""

    runs: dict[str, RunDirState] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def run_dir(output_dir: Path, run_id: str) -> Path:
    """``output_dir/run_id``; raises InvalidRunId for an id that could escape ``output_dir``."""
    return output_dir / validate_run_id(run_id)


def control_dir(output_dir: Path, run_id: str) -> Path:
    return run_dir(output_dir, run_id) / CONTROL


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _stat(path: str | Path) -> os.stat_result | None:
    try:
        return os.stat(path, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def inspect_run_dir(output_dir: Path, run_id: str) -> RunDirState | None:
    """The state of one run directory, or None if it does not exist (as a real directory)."""
    path = run_dir(output_dir, run_id)
    st = _stat(path)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return None
    return _inspect(path, run_id)


def _inspect(path: Path, run_id: str) -> RunDirState:
    # plain string paths: a scan does this for every run directory, every few seconds
    control = os.path.join(path, CONTROL)
    orch = _stat(os.path.join(control, ORCH_TOML))
    has_config = orch is not None and stat.S_ISREG(orch.st_mode)
    evicted = _stat(os.path.join(control, EVICTED)) is not None
    return RunDirState(
        run_id, path, has_config, evicted, _stamp(orch) if orch and has_config else None
    )


def scan_output_dir(output_dir: Path) -> ScanResult:
    """Every ``run_*`` entry of ``output_dir``; illegal names and links land in ``skipped``.

    A missing ``output_dir`` scans as empty: the registry may start before the first run.
    """
    result = ScanResult()
    try:
        entries = list(os.scandir(output_dir))
    except FileNotFoundError:
        return result
    for entry in entries:
        name = entry.name
        if not name.startswith("run_"):
            continue
        if not is_valid_run_id(name):
            # Only a directory that looks like a run (it has a config) is worth a report; a
            # stray file named run_notes.txt is not.
            if entry.is_dir(follow_symlinks=False) and os.path.exists(
                os.path.join(entry.path, CONTROL, ORCH_TOML)
            ):
                shown = name if len(name) <= 80 else name[:80] + "..."
                result.skipped[name] = (
                    f"ignored directory {shown!r} in {output_dir}: not a legal run id "
                    "('run_' followed by 1-64 letters, digits, '_' or '-'); rename it"
                )
            continue
        if entry.is_symlink():
            result.skipped[name] = (
                f"ignored {name} in {output_dir}: a symbolic link; a run directory must be a "
                "real directory inside output_dir (the registry writes into it)"
            )
            continue
        if entry.is_dir(follow_symlinks=False):
            result.runs[name] = _inspect(output_dir / name, name)
    return result


# --- control files --------------------------------------------------------------------------


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` in one step (temp file in the same directory + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_config_bytes(output_dir: Path, run_id: str) -> bytes | None:
    try:
        return (control_dir(output_dir, run_id) / ORCH_TOML).read_bytes()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def _writable_control_dir(output_dir: Path, run_id: str) -> Path:
    """The control directory to write into; refuses a run directory that is a link (it could
    point anywhere) or a ``control`` that is one."""
    path = run_dir(output_dir, run_id)
    for p in (path, path / CONTROL):
        if p.is_symlink():
            raise FileExistsError(f"{p} is a symbolic link; refusing to write through it")
    return path / CONTROL


def write_config(output_dir: Path, run_id: str, toml_text: str) -> Path:
    """Create the run directory if needed and write its ``control/orch.toml`` atomically."""
    path = _writable_control_dir(output_dir, run_id) / ORCH_TOML
    write_atomic(path, toml_text)
    return path


def write_validation_error(output_dir: Path, run_id: str, error: str) -> None:
    path = _writable_control_dir(output_dir, run_id) / VALIDATION_ERROR
    write_atomic(path, error.rstrip("\n") + "\n")


def clear_validation_error(output_dir: Path, run_id: str) -> None:
    (_writable_control_dir(output_dir, run_id) / VALIDATION_ERROR).unlink(missing_ok=True)


def write_evicted(output_dir: Path, run_id: str, reason: str) -> None:
    """Write ``control/evicted.txt`` (the reason), unless the run directory is already gone."""
    st = _stat(run_dir(output_dir, run_id))
    if st is None or not stat.S_ISDIR(st.st_mode):
        return
    write_atomic(_writable_control_dir(output_dir, run_id) / EVICTED, reason.rstrip("\n") + "\n")


def read_evicted_reason(output_dir: Path, run_id: str) -> str:
    try:
        text = (control_dir(output_dir, run_id) / EVICTED).read_text(
            encoding="utf-8", errors="replace"
        )
    except OSError:
        return ""
    return text.strip()[:16000] or "control/evicted.txt exists (no reason given)"
