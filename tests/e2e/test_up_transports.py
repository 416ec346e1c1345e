"""``plexrl up`` with the direct weight transports: adapters reach inference over UCX and over
the collective broadcast group, and the run's later steps are sampled from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.model.tiny import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.mark.parametrize("transport", ["ucx", "collective"])
def test_up_trains_with_adapters_sent_over(transport: str, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "OTEL_"))}
    up = subprocess.run(
        [
            *(sys.executable, "-m", "services", "up", "--runs", "1", "--steps", str(STEPS)),
            *("--max-async-level", "1", "--model", str(model), "--output-dir", str(out)),
            *("--weight-transport", transport, "--no-live"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert up.returncode == 0, f"plexrl up failed:\n{up.stdout}\n{up.stderr}"
    (run_dir,) = [p for p in out.iterdir() if (p / "metrics.jsonl").exists()]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    # Step n waits for policy version >= n - 1: inference must have installed the adapters the
    # trainer sent over this transport, or the last steps could not have been generated.
    assert [m["step"] - m["policy_lag"] for m in metrics][-1] >= STEPS - 2
    trained = [
        json.loads(line) for line in (run_dir / "trainer_steps.jsonl").read_text().splitlines()
    ]
    assert sorted(t["step"] for t in trained) == list(range(STEPS))
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "Traceback" not in trainer_log
