"""``plexrl up`` with the direct weight transports: adapters reach inference over UCX and over
the collective broadcast group, and the run's later steps are sampled from them."""

from __future__ import annotations

from pathlib import Path

import pytest
from up_support import run_up_one_run

from services.model.tiny import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.mark.parametrize("transport", ["ucx", "collective"])
def test_up_trains_with_adapters_sent_over(transport: str, model: Path, tmp_path: Path) -> None:
    up = run_up_one_run(
        tmp_path / "out",
        *("--steps", str(STEPS), "--max-async-level", "1", "--model", str(model)),
        *("--weight-transport", transport),
    )
    assert [m["step"] for m in up.metrics] == list(range(STEPS))
    # Step n waits for policy version >= n - 1: inference must have installed the adapters the
    # trainer sent over this transport, or the last steps could not have been generated.
    assert [m["step"] - m["policy_lag"] for m in up.metrics][-1] >= STEPS - 2
    assert sorted(t["step"] for t in up.trained) == list(range(STEPS))
    assert "Traceback" not in up.log("trainer")
