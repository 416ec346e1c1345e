"""The variable names tests/deploy/contract.py allows are the ones the code really reads."""

from __future__ import annotations

import re

from services.config import ProcessSettings

from .contract import COMMON_PLEXRL_ENV, OTEL_ENV, REPO, SETTINGS_BY_COMMAND, env_read_by


def test_tracing_reads_every_otel_variable_the_deploy_files_may_set() -> None:
    tracing = (REPO / "services" / "bus" / "tracing.py").read_text(encoding="utf-8")
    for name in OTEL_ENV:
        assert f'"{name}"' in tracing, name


def test_every_process_setting_is_used_and_read_through_the_loader() -> None:
    # each field of ProcessSettings is read somewhere outside services/config ...
    code = "".join(
        p.read_text(encoding="utf-8")
        for p in (REPO / "services").rglob("*.py")
        if p.parent.name != "config"
    )
    for name in ProcessSettings.model_fields:
        assert f".{name}" in code, name
    # ... and no service reads a PLEXRL_* variable of its own past the settings loader
    direct = re.compile(r"""(environ\.get|environ\[|getenv)\(?\s*["']PLEXRL_""")
    for path in (REPO / "services").rglob("*.py"):
        assert not direct.search(path.read_text(encoding="utf-8")), path
    assert {"PLEXRL_NATS_URL", "PLEXRL_STREAM_REPLICAS", "PLEXRL_FAULT"} <= COMMON_PLEXRL_ENV


def test_settings_models_give_the_variables_the_deploy_files_rely_on() -> None:
    for command in SETTINGS_BY_COMMAND:
        names = env_read_by(command)
        assert {"PLEXRL_NATS_URL", "OTEL_SERVICE_NAME"} <= names, command
        assert ("PLEXRL_OUTPUT_DIR" in names) == (command != "gateway"), command
    assert {"PLEXRL_MAX_RUNS", "PLEXRL_MAX_LORA_RANK"} <= env_read_by("registry")
    assert {"PLEXRL_MODEL", "PLEXRL_WEIGHT_TRANSPORT", "PLEXRL_DEVICE"} <= env_read_by("trainer")
    assert {"PLEXRL_ENGINE", "PLEXRL_REPLICA_NAME", "PLEXRL_THREADS"} <= env_read_by("inference")
    assert "PLEXRL_MODEL" in env_read_by("orchestrator")
    assert {"PLEXRL_MODEL", "PLEXRL_HOST", "PLEXRL_PORT"} <= env_read_by("gateway")
    assert "PLEXRL_MAX_RUNS" not in env_read_by("orchestrator")


def test_readme_table_lists_every_variable_the_services_read() -> None:
    readme = (REPO / "deploy" / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    documented = set()
    for row in rows:
        first_cell = row.split("|")[1]
        documented |= set(re.findall(r"`((?:PLEXRL|OTEL|TORCH)_[A-Z_]+)`", first_cell))
    read = set().union(*(env_read_by(command) for command in SETTINGS_BY_COMMAND))
    assert documented == read, {
        "read but not documented": read - documented,
        "documented but not read": documented - read,
    }
