"""deploy/local.yml: valid Compose, and every setting it gives is one the service reads."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from schemas.config import load_orch_config
from schemas.run_id import validate_run_id
from services.config import load_settings
from services.up.settings import DEMO_ENVS

from .contract import DEPLOY, RUNS, env_read_by, settings_class

COMPOSE = DEPLOY / "local.yml"
ONE_SHOT = "auth"  # writes credentials and the NATS config before NATS starts (test_auth.py)


def _check_jsonschema() -> str:
    beside = Path(sys.executable).parent / "check-jsonschema"
    found = str(beside) if beside.is_file() else shutil.which("check-jsonschema")
    assert found, "check-jsonschema is not installed (it is in the dev extra)"
    return found


def _validate_compose(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_check_jsonschema(), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))


def plexrl_services(compose: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """``name -> (plexrl command, service)`` for every service that runs the plexrl image."""
    out = {}
    for name, svc in compose["services"].items():
        if not svc.get("image", "").startswith("plexrl:") or name == ONE_SHOT:
            continue
        argv = list(svc.get("entrypoint") or ["plexrl"]) + list(svc.get("command") or [])
        assert argv[0] == "plexrl", f"{name}: entrypoint {argv[0]!r} is not plexrl"
        out[name] = (argv[1], svc)
    return out


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    result = _validate_compose(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok -- validation done" in result.stdout


def test_compose_validation_rejects_an_unknown_key(tmp_path: Path) -> None:
    text = COMPOSE.read_text(encoding="utf-8")
    broken = text.replace('    command: ["registry"]\n', '    comand: ["registry"]\n', 1)
    assert broken != text
    path = tmp_path / "local.yml"
    path.write_text(broken, encoding="utf-8")
    result = _validate_compose(path)
    assert result.returncode == 1
    assert "comand" in result.stdout + result.stderr


def test_compose_validation_rejects_a_wrong_type(tmp_path: Path) -> None:
    text = COMPOSE.read_text(encoding="utf-8")
    broken = text.replace("      retries: 12\n", "      retries: [12]\n", 1)
    assert broken != text
    path = tmp_path / "local.yml"
    path.write_text(broken, encoding="utf-8")
    assert _validate_compose(path).returncode == 1


def test_every_plexrl_service_runs_a_known_command(compose: dict[str, Any]) -> None:
    commands = {name: cmd for name, (cmd, _) in plexrl_services(compose).items()}
    assert commands == {
        "registry": "registry",
        "trainer": "trainer",
        "inference": "inference",
        **{f"orchestrator-{env}": "orchestrator" for env in DEMO_ENVS},
        "orchestrator": "orchestrator",
        "gateway": "gateway",
    }
    assert set(compose["services"]) - set(commands) == {"nats", "jaeger", ONE_SHOT}


def test_compose_sets_only_environment_variables_the_services_read(
    compose: dict[str, Any],
) -> None:
    for name, (command, svc) in plexrl_services(compose).items():
        env = svc.get("environment") or {}
        assert isinstance(env, dict), f"{name}: write environment as a mapping"
        unread = set(env) - env_read_by(command)
        assert not unread, f"{name} (plexrl {command}) sets variables it never reads: {unread}"


def test_compose_environment_is_valid_settings(compose: dict[str, Any]) -> None:
    """The values parse: the service would start with these settings."""
    for name, (command, svc) in plexrl_services(compose).items():
        env = {k: str(v) for k, v in svc["environment"].items()}
        settings = load_settings(settings_class(command), None, {}, environ=env)
        if "output_dir" in type(settings).model_fields:  # the gateway has no run directories
            assert str(settings.output_dir) == env["PLEXRL_OUTPUT_DIR"], name
        if command in ("trainer", "inference", "orchestrator", "gateway"):
            assert str(settings.model) == env["PLEXRL_MODEL"], name


def test_pool_settings_agree_between_registry_trainer_and_inference(
    compose: dict[str, Any],
) -> None:
    svcs = compose["services"]
    for key in ("PLEXRL_MAX_RUNS", "PLEXRL_MAX_LORA_RANK"):
        values = {svcs[s]["environment"][key] for s in ("registry", "trainer", "inference")}
        assert len(values) == 1, f"{key} differs: {values}"
    models = {svcs[s]["environment"]["PLEXRL_MODEL"] for s in ("trainer", "inference")}
    assert models == {"/opt/plexrl/models/tiny"}
    assert svcs["trainer"]["environment"]["PLEXRL_WEIGHT_TRANSPORT"] == "object_store"
    assert int(svcs["registry"]["environment"]["PLEXRL_MAX_RUNS"]) >= len(DEMO_ENVS)


def test_every_plexrl_service_reaches_nats_and_jaeger_by_service_name(
    compose: dict[str, Any],
) -> None:
    for name, (command, svc) in plexrl_services(compose).items():
        env = svc["environment"]
        nats = urlsplit(env["PLEXRL_NATS_URL"])
        assert (nats.scheme, nats.hostname, nats.port) == ("nats", "nats", 4222), name
        otlp = urlsplit(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert (otlp.hostname, otlp.port) == ("jaeger", 4318), name
        assert env["OTEL_TRACES_EXPORTER"] == "otlp", name
        assert env["OTEL_SERVICE_NAME"] == f"plexrl-{command}", name
        depends = svc["depends_on"]
        assert depends["nats"] == {"condition": "service_healthy"}, name
        assert depends["jaeger"] == {"condition": "service_started"}, name


def test_output_directory_is_one_shared_named_volume(compose: dict[str, Any]) -> None:
    assert "outputs" in compose["volumes"]
    for name, (command, svc) in plexrl_services(compose).items():
        if command == "gateway":  # no run directories: it reaches runs through the bus
            assert "PLEXRL_OUTPUT_DIR" not in svc["environment"]
            assert not any(v.startswith("outputs:") for v in svc["volumes"]), name
            continue
        mount = f"outputs:{svc['environment']['PLEXRL_OUTPUT_DIR']}"
        assert mount in svc["volumes"], f"{name} does not mount {mount}"


def test_inference_can_be_scaled(compose: dict[str, Any]) -> None:
    inference = compose["services"]["inference"]
    assert "container_name" not in inference
    assert "ports" not in inference
    assert inference["environment"]["PLEXRL_ENGINE"] == "torch"


def test_orchestrators_start_after_the_services_they_talk_to(compose: dict[str, Any]) -> None:
    for env in DEMO_ENVS:
        depends = compose["services"][f"orchestrator-{env}"]["depends_on"]
        for svc in ("registry", "trainer", "inference"):
            assert depends[svc] == {"condition": "service_healthy"}, (env, svc)
    assert compose["services"]["trainer"]["depends_on"]["registry"] == {
        "condition": "service_healthy"
    }
    assert compose["services"]["orchestrator"]["profiles"] == ["adhoc"]


def test_every_plexrl_service_is_checked_with_plexrl_health(compose: dict[str, Any]) -> None:
    """The check names the service as it registers itself: its PLEXRL_SERVICE, else the
    command's name (tests/deploy/test_health_command.py runs the check against a real one)."""
    for name, (command, svc) in plexrl_services(compose).items():
        check = svc.get("healthcheck")
        assert check is not None, f"{name} has no healthcheck"
        service = svc["environment"].get("PLEXRL_SERVICE", command)
        assert check["test"] == ["CMD", "plexrl", "health", service], name
        interval, timeout = _seconds(check["interval"]), _seconds(check["timeout"])
        assert 0 < timeout < interval, name
        assert _seconds(check["start_period"]) >= 60, name  # torch's import and the connect
        assert check["retries"] >= 3, name
    assert "healthcheck" not in compose["services"][ONE_SHOT]
    # a service another waits for must be able to become healthy
    for name, svc in compose["services"].items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in compose["services"][dep], (name, dep)


def test_every_service_has_a_restart_policy(compose: dict[str, Any]) -> None:
    policies = {name: svc.get("restart") for name, svc in compose["services"].items()}
    assert policies.pop(ONE_SHOT) == "no"
    assert policies.pop("orchestrator") == "no"  # `compose run --rm`: the caller decides
    for env in DEMO_ENVS:
        # a finished run exits 0 and stays down; a crashed one resumes from its checkpoint
        assert re.fullmatch(r"on-failure:\d+", policies.pop(f"orchestrator-{env}")), env
    assert set(policies.values()) == {"unless-stopped"}, policies
    assert set(policies) == {"nats", "jaeger", "registry", "trainer", "inference", "gateway"}


def _seconds(duration: str) -> float:
    """A Compose duration such as ``30s``, ``1m30s`` or ``500ms``, in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_one_orchestrator_per_demo_run_with_its_config(compose: dict[str, Any]) -> None:
    assert "./runs:/runs:ro" in compose["services"]["orchestrator-reverse"]["volumes"]
    run_ids = set()
    for env in DEMO_ENVS:
        cmd = compose["services"][f"orchestrator-{env}"]["command"]
        assert cmd[0] == "orchestrator"
        run_ids.add(validate_run_id(cmd[1]))
        assert cmd[2:] == ["--config", f"/runs/{env}.toml"]
        config = load_orch_config(RUNS / f"{env}.toml")
        assert config.env == env
        rank_limit = int(compose["services"]["trainer"]["environment"]["PLEXRL_MAX_LORA_RANK"])
        assert config.model.lora.rank <= rank_limit
    assert run_ids == {f"run_{env}" for env in DEMO_ENVS}


def test_nats_runs_jetstream_with_the_config_file_and_a_health_check(
    compose: dict[str, Any],
) -> None:
    nats = compose["services"]["nats"]
    assert nats["image"].startswith("nats:2")
    assert "auth:/var/lib/plexrl/auth:ro" in nats["volumes"]
    assert "nats-data:/data" in nats["volumes"]
    cmd = nats["command"]
    assert cmd[cmd.index("-c") + 1] == "/var/lib/plexrl/auth/nats.conf"  # from ./nats.conf
    assert "-js" in cmd
    assert cmd[cmd.index("-sd") + 1] == "/data"
    assert cmd[cmd.index("-m") + 1] == "8222"
    assert set(nats["ports"]) == {"4222:4222", "8222:8222"}
    test = nats["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert "http://127.0.0.1:8222/healthz?js-enabled-only=true" in test


def test_jaeger_accepts_otlp_and_serves_its_ui(compose: dict[str, Any]) -> None:
    jaeger = compose["services"]["jaeger"]
    assert jaeger["image"].startswith("jaegertracing/all-in-one:")
    assert jaeger["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert set(jaeger["ports"]) == {"16686:16686", "4318:4318"}


def test_plexrl_image_is_built_from_the_deploy_dockerfile(compose: dict[str, Any]) -> None:
    for name, (_, svc) in plexrl_services(compose).items():
        assert svc["image"] == "plexrl:local", name
        assert svc["build"]["context"] == "..", name
        assert svc["build"]["dockerfile"] == "deploy/Dockerfile", name
        assert (DEPLOY / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
