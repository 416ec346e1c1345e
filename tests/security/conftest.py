"""One deployment made as the README says, for the adversarial suite: tenants ``acme`` (the
victim) and ``globex`` (the attacker, with small quotas) in ``plexrl-auth`` files written like
``plexrl tenants add``, a nats-server running the accounts config of ``plexrl nats-config``, and
the registry, trainer, inference and the keyed gateway as processes, each with its own
credentials (the services' seed for the three services, the gateway's own for the gateway).

It is built once for the module: every test attacks it with globex's valid credentials (or
none) and then asserts that acme's runs, steps, weights and events are what they were.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from accounts_support import AccountsBroker, accounts_broker

from services.bus import free_port
from services.config.tenants import TenantQuota
from services.model.tiny import build_tiny_model
from services.tenants.credentials import GATEWAY, SERVICES

REPO = Path(__file__).resolve().parents[2]

ATTACKER_QUOTA = TenantQuota(
    max_runs=1,
    max_waiting=1,
    max_run_dirs=3,
    max_store_bytes=64 << 20,
    max_memory_bytes=1 << 20,
    max_streams=4,
    max_consumers=32,
    max_connections=16,
)


@dataclass
class Deployment:
    broker: AccountsBroker
    model: Path
    out: Path
    logs: Path
    gateway: str
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, who: str, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "OTEL_"))}
        env |= self.broker.env(who) | {"PLEXRL_CONNECT_WAIT_S": "30"}
        log = (self.logs / f"{name}.log").open("ab")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "services", *args],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def all_logs(self) -> str:
        return "\n".join(
            f"--- {n}\n{(self.logs / f'{n}.log').read_text(errors='replace')[-3000:]}"
            for n in self.procs
        )

    def key(self, tenant: str) -> str:
        return self.broker.api_key(tenant)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("secure")
    model = build_tiny_model(root / "model", seed=0)
    tenants = {"acme": TenantQuota(max_runs=3), "globex": ATTACKER_QUOTA}
    with accounts_broker(root, tenants) as broker:
        out, logs = root / "out", root / "logs"
        out.mkdir()
        logs.mkdir()
        port = free_port()
        d = Deployment(broker, model, out, logs, f"http://127.0.0.1:{port}")
        common = ("--output-dir", str(out), "--max-runs", "4")
        tenants_file = ("--tenants-file", str(broker.tenants_file))
        d.start("registry", SERVICES, "registry", *common, *tenants_file)
        d.start("trainer", SERVICES, "trainer", "--model", str(model), *common, "--threads", "1")
        d.start(
            "inference", SERVICES, "inference", "--model", str(model), *common, "--threads", "1"
        )
        d.start(
            "gateway",
            GATEWAY,
            *("gateway", "--model", str(model), "--port", str(port), *tenants_file),
            *("--model-alias", "tiny-base", "--max-tokens", "32", "--max-request-tokens", "4096"),
            *("--max-concurrent-per-key", "8"),
        )
        try:
            _wait_http(d)
            yield d
        finally:
            for proc in d.procs.values():
                proc.terminate()
            for proc in d.procs.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


def _wait_http(d: Deployment, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in d.procs.items():
            assert proc.poll() is None, f"{name} exited early:\n{d.all_logs()}"
        try:
            if httpx.get(f"{d.gateway}/healthz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the gateway never answered:\n{d.all_logs()}")
