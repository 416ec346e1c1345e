"""The deployments' authentication: the one-shot auth step of local.yml and the init step of the
nats pods, run here as they are written (with the paths moved into a temporary directory), and
the servers' configs they produce, checked by nats-server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.bus.server import find_nats_server
from services.config.tenants import load_tenants
from services.tenants.credentials import public_key

from .contract import DEPLOY, K8S

AUTH_DIR = "/var/lib/plexrl/auth"
CREDS = f"{AUTH_DIR}/services.nk"


def _run_script(script: str, auth: Path, base: Path, **env: str) -> None:
    script = script.replace(AUTH_DIR, str(auth)).replace("/etc/nats/nats.conf", str(base))
    environ = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"} | env
    result = subprocess.run(
        ["/bin/sh", "-ec", script], env=environ, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _nats_server_test(conf: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(conf)],
        capture_output=True,
        text=True,
        env=os.environ | env,
        timeout=30,
    )


def _check_auth_dir(auth: Path) -> dict[str, str]:
    assert set(load_tenants(auth / "tenants.toml").tenants) == {"team-a", "team-b"}
    keys = {name: public_key(auth / f"{name}.nk") for name in ("services", "team-a", "team-b")}
    conf = (auth / "nats.conf").read_text()
    for key in keys.values():
        assert key in conf
    return keys


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "local.yml").read_text(encoding="utf-8"))


def test_compose_auth_step_writes_credentials_and_a_config_nats_accepts(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    auth = compose["services"]["auth"]
    assert auth["entrypoint"] == ["/bin/sh", "-ec"]
    assert f"auth:{AUTH_DIR}" in auth["volumes"]
    assert "./nats.conf:/etc/nats/nats.conf:ro" in auth["volumes"]
    assert auth["restart"] == "no"
    _run_script(auth["command"][0], tmp_path, DEPLOY / "nats.conf")
    keys = _check_auth_dir(tmp_path)
    result = _nats_server_test(tmp_path / "nats.conf")
    assert result.returncode == 0, result.stderr
    assert (DEPLOY / "nats.conf").read_text() in (tmp_path / "nats.conf").read_text()

    _run_script(auth["command"][0], tmp_path, DEPLOY / "nats.conf")  # a restart of the stack
    assert _check_auth_dir(tmp_path) == keys


def test_compose_nats_starts_after_auth_and_services_use_their_seed(
    compose: dict[str, Any],
) -> None:
    services = compose["services"]
    nats = services["nats"]
    assert nats["depends_on"]["auth"] == {"condition": "service_completed_successfully"}
    assert f"auth:{AUTH_DIR}:ro" in nats["volumes"]
    plexrl = {n: s for n, s in services.items() if s.get("image") == "plexrl:local" and n != "auth"}
    assert plexrl
    for name, svc in plexrl.items():
        # the gateway acts as each tenant with the tenant's seed: its own reaches nothing
        seed = f"{AUTH_DIR}/gateway.nk" if name == "gateway" else CREDS
        assert svc["environment"]["PLEXRL_NATS_CREDS"] == seed, name
        assert f"auth:{AUTH_DIR}:ro" in svc["volumes"], name
    for name in ("registry", "gateway"):  # the quotas, and the API keys' digests
        env = services[name]["environment"]
        assert env["PLEXRL_TENANTS_FILE"] == f"{AUTH_DIR}/tenants.toml", name
    assert "auth" in compose["volumes"]


def _k8s_docs() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
    return docs


def test_nats_pods_init_step_writes_one_config_for_the_cluster(tmp_path: Path) -> None:
    docs = _k8s_docs()
    sts = next(d for d in docs if d["kind"] == "StatefulSet" and d["metadata"]["name"] == "nats")
    pod = sts["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    nats = pod["containers"][0]
    assert nats["args"] == ["-c", f"{AUTH_DIR}/nats.conf"]
    config_map = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "nats-config"
    )
    base = tmp_path / "base.conf"
    base.write_text(config_map["data"]["nats.conf"])
    auth = tmp_path / "auth"
    auth.mkdir()
    _run_script(init["args"][0], auth, base, POD_NAME="nats-0")
    _check_auth_dir(auth)
    result = _nats_server_test(auth / "nats.conf", POD_NAME="nats-1")
    assert result.returncode == 0, result.stderr
    # another server waits for nats-0's file, and leaves it as it is
    before = (auth / "nats.conf").read_bytes()
    _run_script(init["args"][0], auth, base, POD_NAME="nats-2")
    assert (auth / "nats.conf").read_bytes() == before


def test_every_plexrl_pod_reads_the_services_seed_from_the_auth_claim() -> None:
    docs = _k8s_docs()
    env = next(
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "plexrl-env"
    )
    assert env["data"]["PLEXRL_NATS_CREDS"] == CREDS
    claim = next(
        d
        for d in docs
        if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "plexrl-auth"
    )
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    for doc in workloads:
        pod = doc["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes") or []}
        for c in pod["containers"]:
            if not c["image"].startswith("plexrl"):
                continue
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == AUTH_DIR)
            assert mount["readOnly"] is True, doc["metadata"]["name"]
            assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == "plexrl-auth"
