"""The filesystem side: scanning run directories and atomic control-file writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from schemas.run_id import InvalidRunId
from services.registry import discovery as fs

from .helpers import VALID_TOML, write_orch


def test_scan_sees_configs_evictions_and_changes(tmp_path: Path) -> None:
    assert fs.scan_output_dir(tmp_path / "not-yet").runs == {}  # the registry may start first
    write_orch(tmp_path, "run_a")
    write_orch(tmp_path, "run_gone").parent.joinpath("evicted.txt").write_text("why\n")
    (tmp_path / "run_empty").mkdir()  # no config yet
    (tmp_path / "run_notes.txt").write_text("a file, not a run")
    (tmp_path / "other").mkdir()
    result = fs.scan_output_dir(tmp_path)
    assert sorted(result.runs) == ["run_a", "run_empty", "run_gone"] and result.skipped == {}
    a, gone, empty = (result.runs[r] for r in ("run_a", "run_gone", "run_empty"))
    assert (a.has_config, a.evicted) == (True, False)
    assert (gone.has_config, gone.evicted) == (True, True)
    assert (empty.has_config, empty.stamp) == (False, None)
    assert fs.read_evicted_reason(tmp_path, "run_gone") == "why"
    before = a.stamp
    write_orch(tmp_path, "run_a", VALID_TOML + "\nseed = 1\n")
    assert fs.scan_output_dir(tmp_path).runs["run_a"].stamp != before


def test_atomic_writes_replace_whole_files_and_leave_no_temporaries(tmp_path: Path) -> None:
    path = fs.write_config(tmp_path, "run_a", "max_steps = 1\n")
    assert path == tmp_path / "run_a" / "control" / "orch.toml"
    inode = path.stat().st_ino
    fs.write_config(tmp_path, "run_a", "max_steps = 2\n")
    assert path.read_text() == "max_steps = 2\n"
    assert path.stat().st_ino != inode  # renamed into place, never rewritten in place
    fs.write_validation_error(tmp_path, "run_a", "bad\n")
    assert (path.parent / "config_validation_error.txt").read_text() == "bad\n"
    fs.clear_validation_error(tmp_path, "run_a")
    fs.clear_validation_error(tmp_path, "run_a")  # twice is fine
    assert sorted(os.listdir(path.parent)) == ["orch.toml"]


def test_no_path_is_built_from_an_illegal_run_id(tmp_path: Path) -> None:
    for bad in ("run_../x", "run_a/b", "../run_a", "run_a.b"):
        with pytest.raises(InvalidRunId):
            fs.write_config(tmp_path, bad, "x = 1\n")
    assert list(tmp_path.iterdir()) == []
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "out").mkdir()
    os.symlink(outside, tmp_path / "out" / "run_link")
    with pytest.raises(FileExistsError, match="symbolic link"):
        fs.write_config(tmp_path / "out", "run_link", "x = 1\n")
    assert list(outside.iterdir()) == []
    fs.write_evicted(tmp_path / "out", "run_missing", "gone")  # no directory: nothing written
    fs.write_evicted(tmp_path / "out", "run_link", "gone")  # a link: never followed
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["run_link"]
