"""What the deployment files may set: the environment variables each plexrl command reads.

A service reads ``PLEXRL_<FIELD>`` for every field of its settings model (services/config/
loader.py) and of ``ProcessSettings`` (services/config/process.py: ``PLEXRL_NATS_URL``,
``PLEXRL_STREAM_REPLICAS``... read by every command), the metrics variables of
services/telemetry/metrics.py, the ``OTEL_*`` variables of services/bus/tracing.py, and the
container health check reads its own (deploy/healthcheck.py). The deploy
tests compare the variables set in deploy/local.yml and deploy/k8s/ with these sets.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from services.config import ProcessSettings, env_name

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
RUNS = DEPLOY / "runs"

# The settings model of each `plexrl <command>` a deployment runs as a service.
SETTINGS_BY_COMMAND = {
    "registry": "services.registry.settings:RegistrySettings",
    "trainer": "services.trainer.settings:TrainerSettings",
    "inference": "services.inference.settings:InferenceSettings",
    "orchestrator": "services.orchestrator.settings:OrchestratorSettings",
    "gateway": "services.gateway.settings:GatewaySettings",
}

# Read by every command: the process settings (metrics port and host among them), and the
# standard OpenTelemetry fallbacks for where metrics are served.
COMMON_PLEXRL_ENV = frozenset(env_name(name) for name in ProcessSettings.model_fields)
METRICS_ENV = frozenset({"OTEL_EXPORTER_PROMETHEUS_PORT", "OTEL_EXPORTER_PROMETHEUS_HOST"})

# Read by services/bus/tracing.py (setup_tracing); a test checks each name is in that file.
OTEL_ENV = frozenset(
    {
        "OTEL_SERVICE_NAME",
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    }
)

# Read by torchrun, which starts the trainer's ranks (deploy/k8s/trainer.yaml).
TORCHRUN_ENV = frozenset({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE"})

# Image names (without tag) whose containers run plexrl.
PLEXRL_IMAGES = frozenset({"plexrl", "plexrl-gpu"})


def settings_class(command: str) -> Any:
    """The settings model ``plexrl <command>`` loads; a clear failure if it does not exist."""
    target = SETTINGS_BY_COMMAND.get(command)
    assert target is not None, (
        f"deploy files run `plexrl {command}`, which has no entry in SETTINGS_BY_COMMAND "
        f"({sorted(SETTINGS_BY_COMMAND)}): add its settings model to tests/deploy/contract.py"
    )
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    cls = getattr(module, attr, None)
    assert cls is not None, f"{module_name} has no {attr}: update SETTINGS_BY_COMMAND"
    return cls


def healthcheck_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_healthcheck", DEPLOY / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def env_read_by(command: str) -> frozenset[str]:
    """Every environment variable a container running ``plexrl <command>`` reads."""
    fields = settings_class(command).model_fields
    own = {env_name(name) for name in fields}
    health = set(healthcheck_module().ENV_VARS)
    torchrun = TORCHRUN_ENV if command == "trainer" else frozenset()
    return frozenset(own | COMMON_PLEXRL_ENV | METRICS_ENV | OTEL_ENV | health | torchrun)


def image_name(image: str) -> str:
    """``registry.example.com/plexrl:0.1`` -> ``plexrl``."""
    last = image.rsplit("/", 1)[-1]
    return last.split("@", 1)[0].split(":", 1)[0]
