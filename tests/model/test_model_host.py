"""The allocator setting every plexrl process applies (services/model/host.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SNIPPET = (
    "from services.model.host import tune_allocator; print(tune_allocator(), tune_allocator())"
)


def _run(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("PLEXRL_MALLOC_TUNING", None)
    out = subprocess.run(
        [sys.executable, "-c", SNIPPET],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return out.stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tunes_glibc_once_and_says_so() -> None:
    # True twice: the second call reports the first call's outcome without calling mallopt again.
    assert _run() == "True True"


@pytest.mark.parametrize(
    "env",
    [
        {"PLEXRL_MALLOC_TUNING": "0"},
        {"PLEXRL_MALLOC_TUNING": "off"},
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
    ],
)
def test_operator_settings_win(env: dict[str, str]) -> None:
    assert _run(**env) == "False False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cli_applies_it_before_a_command_runs(tmp_path) -> None:
    probe = (
        "import services.model.host as h; from services.cli import main; "
        f"rc = main(['schemas', 'export', '--dir', {str(tmp_path)!r}]); print(rc, h._tuned)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip().splitlines()[-1] == "0 True"
