"""``plexrl up --full-weights``: one run trains the whole model, inference installs every version
in place, and the run's later steps are sampled from those versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open
from up_support import run_up_one_run

from services.model.tiny import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 4


@pytest.mark.parametrize("transport", ["object_store", "ucx"])
def test_up_full_weights_trains_and_serves_each_version(transport: str, tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny", seed=0)
    up = run_up_one_run(
        tmp_path / "out",
        *("--full-weights", "--steps", str(STEPS), "--max-async-level", "1"),
        *(
            "--model",
            str(model),
            "--weight-transport",
            transport,
            "--config",
            str(_config(tmp_path)),
        ),
    )
    assert [m["step"] for m in up.metrics] == list(range(STEPS))
    # Step n waits for policy version >= n - 1: inference must have installed the full weights
    # the trainer sent, or the last steps could not have been generated.
    assert [m["step"] - m["policy_lag"] for m in up.metrics][-1] >= STEPS - 2
    assert sorted(t["step"] for t in up.trained) == list(range(STEPS))
    assert {t["weights"] for t in up.trained} == {"full"}
    # The last checkpoint holds the whole model, moved away from the base.
    (ckpt,) = [p for p in (up.run_dir / "checkpoints").iterdir() if p.name == f"step_{STEPS}"]
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["kind"] == "full"
    with (
        safe_open(str(ckpt / "model.safetensors"), "pt") as trained_file,
        safe_open(str(model / "model.safetensors"), "pt") as base_file,
    ):
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not trained_file.get_tensor(name).equal(base_file.get_tensor(name))
    for service in ("trainer", "inference"):
        assert "Traceback" not in up.log(service), up.log(service)


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "up.toml"
    # A checkpoint at the last step (the default interval is 10).
    path.write_text("[run.ckpt]\ninterval = 2\n")
    return path


def test_full_weights_take_one_run_and_a_smaller_step() -> None:
    from services.config import SettingsError, load_settings
    from services.up.settings import FULL_WEIGHTS_LR, UpSettings

    settings = load_settings(UpSettings, None, {"full_weights": True}, environ={})
    assert (settings.runs, settings.slots) == (1, 1)
    assert settings.run_config("reverse", 0).optim.lr == FULL_WEIGHTS_LR
    lora = load_settings(UpSettings, None, {"runs": 5}, environ={})
    assert lora.slots == 5 and lora.run_config("reverse", 0).optim.lr == 2e-3
    with pytest.raises(SettingsError, match="takes runs = 1"):
        load_settings(UpSettings, None, {"full_weights": True, "runs": 3}, environ={})
