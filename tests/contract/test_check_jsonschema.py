"""The schemas work outside Python: the ``check-jsonschema`` CLI (its own regex engine, ECMA-262
as JSON Schema specifies) accepts every valid example and rejects every invalid one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .vectors import JSON_DIR, TAGS, examples

_BIN = Path(sys.executable).parent / "check-jsonschema"
CHECK_JSONSCHEMA = str(_BIN) if _BIN.exists() else shutil.which("check-jsonschema")


@pytest.fixture(scope="module")
def results() -> Iterator[dict[tuple[str, str], subprocess.CompletedProcess[str]]]:
    """One run per (event, valid|invalid), all started at once: each costs a process start."""
    assert CHECK_JSONSCHEMA, "check-jsonschema is a dev dependency: pip install -e '.[dev]'"
    running = {}
    for kind in ("valid", "invalid"):
        by_tag: dict[str, list[str]] = {}
        for e in examples(kind, all_versions=kind == "valid"):
            by_tag.setdefault(e.tag, []).append(str(e.path))
        for tag, files in by_tag.items():
            cmd = [CHECK_JSONSCHEMA, "--schemafile", str(JSON_DIR / f"{tag}.json"), *files]
            running[(tag, kind)] = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
    done = {}
    for key, proc in running.items():
        out, _ = proc.communicate(timeout=60)
        done[key] = subprocess.CompletedProcess(proc.args, proc.returncode, out)
    yield done


@pytest.mark.parametrize("tag", TAGS)
def test_check_jsonschema_accepts_valid_examples(
    tag: str, results: dict[tuple[str, str], subprocess.CompletedProcess[str]]
) -> None:
    proc = results[(tag, "valid")]
    assert proc.returncode == 0, proc.stdout
    assert "ok -- validation done" in proc.stdout


@pytest.mark.parametrize("tag", TAGS)
def test_check_jsonschema_rejects_each_invalid_example(
    tag: str, results: dict[tuple[str, str], subprocess.CompletedProcess[str]]
) -> None:
    proc = results[(tag, "invalid")]
    assert proc.returncode == 1, proc.stdout
    # It reports each failing file as "<path>::<json path>: <message>".
    for e in examples("invalid", all_versions=False):
        if e.tag == tag:
            assert f"{e.path}::" in proc.stdout, (e.path.name, proc.stdout)
