"""Run ``plexrl up`` as a user would, and read back what it wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class UpResult:
    out: Path
    run_dir: Path
    metrics: list[dict[str, Any]]
    """``metrics.jsonl`` of the one run: one object per step"""
    trained: list[dict[str, Any]]
    """``trainer_steps.jsonl`` of the one run: one object per trained step"""

    def log(self, service: str) -> str:
        return (self.out / "logs" / f"{service}.log").read_text()


def clean_env() -> dict[str, str]:
    """The caller's environment without its PLEXRL_ and OTEL_ variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "OTEL_"))}


def plexrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "services", *args]


def run_up(
    out: Path, *args: str, timeout: float = 240.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``plexrl up ARGS --output-dir OUT --no-live`` in a clean environment (plus ``env``),
    asserted to exit 0."""
    up = subprocess.run(
        plexrl("up", *args, "--output-dir", str(out), "--no-live"),
        env=clean_env() | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert up.returncode == 0, f"plexrl up failed:\n{up.stdout}\n{up.stderr}"
    return up


def run_up_one_run(
    out: Path, *args: str, timeout: float = 240.0, env: dict[str, str] | None = None
) -> UpResult:
    """``plexrl up --runs 1 ARGS --output-dir OUT --no-live``, asserted to exit 0, with a clean
    environment (no PLEXRL_ or OTEL_ variables of the caller) plus ``env``."""
    run_up(out, "--runs", "1", *args, timeout=timeout, env=env)
    (run_dir,) = [p for p in out.iterdir() if (p / "metrics.jsonl").exists()]
    return UpResult(
        out, run_dir, _lines(run_dir / "metrics.jsonl"), _lines(run_dir / "trainer_steps.jsonl")
    )


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]
