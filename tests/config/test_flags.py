"""Flags generated from a settings model, and the precedence defaults < TOML < env < flags."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, Field

from services.config import (
    DEFAULT_NATS_URL,
    SettingsError,
    add_common_args,
    add_settings_flags,
    nats_url,
    process_settings,
    settings_from_args,
)

REPO = Path(__file__).resolve().parents[2]


class Demo(BaseModel):
    model: Path = Field(description="a model directory")
    max_runs: int = Field(4, ge=1, description="slots, 100% used")
    scale: float = 0.5
    transport: Literal["fs", "net"] = Field("fs", description="how weights travel")
    wait: bool = Field(True, description="wait at the end")
    hooks: list[str] = Field(default_factory=list, description="extra checks")
    table: dict[str, int] = Field(default_factory=dict, description="TOML only")


def _parser(**kwargs: object) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demo")
    add_common_args(parser)
    add_settings_flags(parser, Demo, **kwargs)  # type: ignore[arg-type]
    return parser


def test_each_field_becomes_one_typed_flag() -> None:
    argv = ["--model", "m", "--max-runs", "8", "--scale", "2", "--transport", "net", "--no-wait"]
    argv += ["--hooks", "a:b,c:d", "--hook", "e:f", "g:h"]
    args = _parser(aliases={"hooks": ["--hook"]}).parse_args(argv)
    assert vars(args) == {
        "config": None,
        "model": Path("m"),
        "max_runs": 8,
        "scale": 2.0,
        "transport": "net",
        "wait": False,
        "hooks": ["a:b", "c:d", "e:f", "g:h"],
    }
    # a flag not given is absent, so it never hides the file or the environment
    assert vars(_parser().parse_args([])) == {"config": None}
    with pytest.raises(SystemExit):
        _parser().parse_args(["--transport", "nfs"])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--table", "x"])  # a table is set in the TOML file only


def test_help_shows_description_default_and_variable() -> None:
    text = " ".join(_parser().format_help().split())
    assert "--model PATH a model directory (required; env PLEXRL_MODEL)" in text
    assert "--max-runs N slots, 100% used (default 4; env PLEXRL_MAX_RUNS)" in text
    assert "--scale X scale (default 0.5; env PLEXRL_SCALE)" in text
    assert "--wait, --no-wait wait at the end (default true; env PLEXRL_WAIT)" in text
    assert "--transport {fs,net} how weights travel (default fs; env PLEXRL_TRANSPORT)" in text
    assert f"(default {DEFAULT_NATS_URL}; env PLEXRL_NATS_URL)" in text
    assert "PLEXRL_" not in " ".join(_parser(from_env=False).format_help().split()[-30:])


def test_precedence_is_defaults_then_toml_then_environment_then_flags(tmp_path: Path) -> None:
    toml = tmp_path / "demo.toml"
    toml.write_text('model = "from-toml"\nmax_runs = 2\nscale = 3.0\n[table]\na = 1\n')
    env = {"PLEXRL_MAX_RUNS": "5", "PLEXRL_SCALE": "4", "PLEXRL_HOOKS": "x:y"}
    args = _parser().parse_args(["--config", str(toml), "--max-runs", "9"])
    got = settings_from_args(Demo, args, environ=env)
    assert (got.model, got.max_runs, got.scale, got.hooks) == (Path("from-toml"), 9, 4.0, ["x:y"])
    assert (got.transport, got.wait, got.table) == ("fs", True, {"a": 1})
    with pytest.raises(SettingsError, match=r"max_runs: .* \(set by PLEXRL_MAX_RUNS\)"):
        settings_from_args(Demo, _parser().parse_args(["--model", "m"]), {"PLEXRL_MAX_RUNS": "0"})


def test_process_settings_and_the_nats_url() -> None:
    assert process_settings({}).stream_replicas == 1
    assert process_settings({"PLEXRL_STREAM_REPLICAS": "3", "PLEXRL_MALLOC_TUNING": "off"}) == (
        process_settings({}).model_copy(update={"stream_replicas": 3, "malloc_tuning": False})
    )
    with pytest.raises(SettingsError, match="PLEXRL_STREAM_REPLICAS"):
        process_settings({"PLEXRL_STREAM_REPLICAS": "6"})
    parser = _parser()
    flag = parser.parse_args(["--nats-url", "nats://a:1"])
    assert nats_url(flag) == "nats://a:1"
    monkey = pytest.MonkeyPatch()
    with monkey.context() as m:
        m.setenv("PLEXRL_NATS_URL", "nats://b:2")
        assert nats_url(parser.parse_args([])) == "nats://b:2"
        assert nats_url(flag) == "nats://a:1"
        m.delenv("PLEXRL_NATS_URL")
        assert nats_url(parser.parse_args([])) == DEFAULT_NATS_URL


@pytest.mark.parametrize(
    ("spec", "status"),
    [
        ("trainer.ack@run_a:3", 137),
        ("trainer.ack:3", 137),
        ("trainer.ack", 137),
        ("trainer.ack@run_b:3", 0),
        ("trainer.ack@run_a:4", 0),
        ("registry.ack", 0),
        ("", 0),
    ],
)
def test_a_fault_point_exits_137_only_where_named(spec: str, status: int) -> None:
    code = "from services.launch.faults import crash_point; crash_point('trainer.ack', 'run_a', 3)"
    env = {"PLEXRL_FAULT": spec, "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, timeout=60)
    assert done.returncode == status
