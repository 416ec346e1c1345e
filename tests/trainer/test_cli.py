"""``plexrl trainer``: instant help, settings from flags, environment and TOML, clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.config import DEFAULT_TARGET_MODULES
from services.config import SettingsError, load_settings
from services.trainer.intake import place
from services.trainer.settings import TrainerSettings, default_threads

REPO = Path(__file__).parents[2]


def _plexrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


HEAVY = ("torch", "numpy", "transformers", "peft", "safetensors", "tokenizers", "triton")
"""What makes a start slow; ``--help`` imports none of them (what it costs is not timed here: a
loaded machine would make any limit flaky)."""


def test_help_is_instant_and_imports_no_torch():
    code = (
        "import sys\n"
        "from services.cli import main\n"
        "try:\n"
        "    main(['trainer', '--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0\n"
        f"loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        "assert not loaded, f'--help imported {loaded}'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for flag in ("--model", "--output-dir", "--max-runs", "--weight-transport", "--threads"):
        assert flag in done.stdout


def test_a_bad_setting_is_a_clear_usage_error(tiny_dir):
    done = _plexrl("trainer", "--model", str(tiny_dir), "--max-runs", "0")
    assert done.returncode == 2
    assert (
        "invalid TrainerSettings settings: max_runs: Input should be greater than or equal to 1"
        in (done.stderr)
    )


def test_a_missing_model_says_how_to_get_one(tmp_path):
    done = _plexrl("trainer", "--model", str(tmp_path / "nope"))
    assert done.returncode == 2
    assert "is not a Hugging Face model directory" in done.stderr
    assert f"plexrl model tiny {tmp_path / 'nope'}" in done.stderr


def test_no_nats_server_is_reported_not_hung(tiny_dir):
    from services.bus import free_port

    # A service waits PLEXRL_CONNECT_WAIT_S for its first connection; 0 gives up at once.
    done = _plexrl(
        "trainer",
        "--model",
        str(tiny_dir),
        "--nats-url",
        f"nats://127.0.0.1:{free_port()}",
        env={**os.environ, "PLEXRL_CONNECT_WAIT_S": "0"},
    )
    assert done.returncode == 1
    assert "cannot reach NATS" in done.stderr


def test_settings_come_from_toml_environment_and_flags_in_that_order(tmp_path):
    toml = tmp_path / "trainer.toml"
    toml.write_text(
        'model = "/models/a"\nmax_runs = 8\nweight_transport = "filesystem"\nthreads = 3\n'
    )
    env = {"PLEXRL_WEIGHT_TRANSPORT": "object_store", "PLEXRL_TARGET_MODULES": "q_proj, v_proj"}
    settings = load_settings(TrainerSettings, toml, {"threads": 5}, environ=env)
    assert settings.model == Path("/models/a")
    assert settings.max_runs == 8
    assert settings.weight_transport == "object_store"
    assert settings.target_modules == ["q_proj", "v_proj"]
    assert (settings.threads, settings.num_threads) == (5, 5)
    with pytest.raises(SettingsError, match="weight_transport: Input should be 'object_store'"):
        load_settings(TrainerSettings, None, {"model": "m", "weight_transport": "nfs"}, environ={})
    with pytest.raises(SettingsError, match="model: Field required"):
        load_settings(TrainerSettings, None, {}, environ={})


def test_defaults():
    from services.model.families import default_target_modules

    settings = TrainerSettings(model=Path("m"))
    # unset: the model family's default, which for a Llama is plexrl's default list
    assert settings.target_modules is None
    assert default_target_modules("llama") == DEFAULT_TARGET_MODULES
    assert settings.num_threads == default_threads() >= 1
    assert settings.weight_transport == "object_store"


@pytest.mark.parametrize(
    ("step", "expected"),
    [(0, "done"), (2, "done"), (3, "uncommitted"), (4, "uncommitted"), (5, "train"), (6, "wait")],
)
def test_where_a_batch_stands(step, expected):
    # a run whose checkpoint holds 3 steps and that has trained 5
    assert place(step, next_step=5, committed_step=3) == expected
