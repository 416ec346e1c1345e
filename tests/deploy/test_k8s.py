"""deploy/k8s/: valid Kubernetes objects (offline schemas), consistent with each other and with
the settings the services read."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.config import parse_orch_config
from schemas.run_id import validate_run_id
from services.config import load_settings
from services.up.settings import DEMO_ENVS

from .contract import K8S, PLEXRL_IMAGES, RUNS, env_read_by, image_name, settings_class

try:
    import kubernetes_validate
except ModuleNotFoundError:  # pragma: no cover - a clear failure, not a skip
    kubernetes_validate = None

# The oldest Kubernetes the manifests are written for, and the newest the schemas know.
K8S_VERSIONS = ("1.29", "1.37")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job")


def _validate(doc: dict[str, Any], version: str) -> None:
    assert kubernetes_validate is not None, (
        "kubernetes-validate is not installed: it ships the Kubernetes JSON schemas these "
        "tests need (pip install 'kubernetes-validate==1.37.0'; it belongs in the dev extra)"
    )
    kubernetes_validate.validate(doc, version, strict=True)


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in _manifest_files():
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                out.append((path.name, doc))
    return out


def _find(docs: list[tuple[str, dict[str, Any]]], kind: str, name: str) -> dict[str, Any]:
    for _, doc in docs:
        if doc["kind"] == kind and doc["metadata"]["name"] == name:
            return doc
    raise AssertionError(f"no {kind} {name} in deploy/k8s")


def _of_kind(docs: list[tuple[str, dict[str, Any]]], kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in docs if doc["kind"] == kind]


def _plexrl_containers(
    docs: list[tuple[str, dict[str, Any]]],
) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """``(workload name, plexrl command, container)`` for every container of a plexrl image."""
    for _, doc in docs:
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            if image_name(c["image"]) not in PLEXRL_IMAGES:
                continue
            command, args = c.get("command"), c.get("args") or []
            if command == ["torchrun"]:
                at = args.index("-m")
                assert args[at + 1] == "services", "torchrun must run -m services"
                yield doc["metadata"]["name"], args[at + 2], c
            else:
                assert command in (None, ["plexrl"]), f"{c['name']}: command {command}"
                yield doc["metadata"]["name"], args[0], c


def _container_env(
    docs: list[tuple[str, dict[str, Any]]], container: dict[str, Any]
) -> dict[str, str]:
    """The container's environment with envFrom ConfigMaps expanded; downward-API values are
    stood in for by a pod-name-like placeholder."""
    env: dict[str, str] = {}
    for ref in container.get("envFrom") or []:
        data = _find(docs, "ConfigMap", ref["configMapRef"]["name"])["data"]
        env.update({k: str(v) for k, v in data.items()})
    for item in container.get("env") or []:
        env[item["name"]] = item.get("value", "pod-0")
    return env


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(
    docs: list[tuple[str, dict[str, Any]]], version: str
) -> None:
    kinds = set()
    for filename, doc in docs:
        try:
            _validate(doc, version)
        except Exception as exc:
            message = getattr(exc, "message", str(exc))
            raise AssertionError(
                f"{filename}: {doc['kind']} {doc['metadata']['name']}: {message}"
            ) from None
        kinds.add(doc["kind"])
    assert kinds == {
        "Namespace",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "Deployment",
        "Job",
        "PersistentVolumeClaim",
        "PodDisruptionBudget",
    }


def test_schema_validation_rejects_an_unknown_field_and_a_wrong_type(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    trainer = _find(docs, "StatefulSet", "trainer")
    _validate(trainer, K8S_VERSIONS[0])

    typo = copy.deepcopy(trainer)
    typo["spec"]["replica"] = typo["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        _validate(typo, K8S_VERSIONS[0])

    wrong_type = copy.deepcopy(trainer)
    wrong_type["spec"]["template"]["spec"]["containers"][0]["args"] = "--nnodes=2"
    with pytest.raises(kubernetes_validate.ValidationError, match="array"):
        _validate(wrong_type, K8S_VERSIONS[0])


def test_kustomization_lists_every_manifest_and_every_image() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
    assert kustomization["kind"] == "Kustomization"
    assert kustomization["namespace"] == "plexrl"
    assert sorted(kustomization["resources"]) == [p.name for p in _manifest_files()]
    assert {i["name"] for i in kustomization["images"]} == PLEXRL_IMAGES


def test_manifests_leave_the_namespace_to_kustomize(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    assert _find(docs, "Namespace", "plexrl")
    for filename, doc in docs:
        assert "namespace" not in doc["metadata"], filename


def test_k8s_sets_only_environment_variables_the_services_read(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    seen = set()
    for workload, command, container in _plexrl_containers(docs):
        env = _container_env(docs, container)
        unread = set(env) - env_read_by(command)
        assert not unread, f"{workload} (plexrl {command}) sets variables it never reads: {unread}"
        settings = load_settings(settings_class(command), None, {}, environ=env)
        if command != "gateway":  # the gateway has no run directories
            assert str(settings.output_dir) == "/var/lib/plexrl/outputs"
        assert env["PLEXRL_NATS_URL"] == "nats://nats:4222"
        assert env["OTEL_SERVICE_NAME"] == f"plexrl-{command}"
        seen.add((workload, command))
    assert seen == {
        ("registry", "registry"),
        ("trainer", "trainer"),
        ("inference", "inference"),
        *((f"orchestrator-{env}", "orchestrator") for env in DEMO_ENVS),
        ("gateway", "gateway"),
    }


def test_pool_settings_are_shared_by_registry_trainer_and_inference(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    for workload, command, container in _plexrl_containers(docs):
        refs = {r["configMapRef"]["name"] for r in container.get("envFrom") or []}
        if command == "gateway":  # plexrl-env names the output directory it never reads
            assert refs == {"plexrl-model-env"}, workload
            continue
        assert "plexrl-env" in refs, workload
        assert ("plexrl-pool-env" in refs) == (command != "orchestrator"), workload
        assert ("plexrl-model-env" in refs) == (command != "registry"), workload


def test_references_between_objects_resolve(docs: list[tuple[str, dict[str, Any]]]) -> None:
    for _, doc in docs:
        if doc["kind"] not in WORKLOAD_KINDS:
            continue
        pod = doc["spec"]["template"]["spec"]
        for volume in pod.get("volumes") or []:
            if "persistentVolumeClaim" in volume:
                _find(docs, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
            if "configMap" in volume:
                _find(docs, "ConfigMap", volume["configMap"]["name"])
        mounted = {v["name"] for v in pod.get("volumes") or []} | {
            t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates") or []
        }
        for c in pod["containers"]:
            for m in c.get("volumeMounts") or []:
                assert m["name"] in mounted, (doc["metadata"]["name"], m["name"])
        labels = doc["spec"]["template"]["metadata"]["labels"]
        selector = doc["spec"].get("selector", {}).get("matchLabels", {})
        assert selector.items() <= labels.items(), doc["metadata"]["name"]
    pod_labels = [
        doc["spec"]["template"]["metadata"]["labels"]
        for _, doc in docs
        if doc["kind"] in WORKLOAD_KINDS
    ]
    for svc in _of_kind(docs, "Service"):
        selector = svc["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pod_labels), svc
    for sts in _of_kind(docs, "StatefulSet"):
        headless = _find(docs, "Service", sts["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"
        assert headless["spec"]["publishNotReadyAddresses"] is True


def test_plexrl_pods_run_as_the_image_user(docs: list[tuple[str, dict[str, Any]]]) -> None:
    for workload, _, container in _plexrl_containers(docs):
        pod = next(
            d["spec"]["template"]["spec"]
            for _, d in docs
            if d["kind"] in WORKLOAD_KINDS and d["metadata"]["name"] == workload
        )
        ctx = pod["securityContext"]
        assert ctx["runAsNonRoot"] is True
        assert ctx["runAsUser"] == ctx["fsGroup"] == 10001, workload
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        if workload == "gateway":
            assert set(mounts) == {"/var/lib/plexrl/auth"}
            continue
        assert mounts["/var/lib/plexrl/outputs"] == "outputs", workload


def test_output_directory_is_a_read_write_many_claim(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    pvc = _find(docs, "PersistentVolumeClaim", "plexrl-outputs")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]


def test_trainer_runs_under_torchrun_with_one_node_per_pod(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    sts = _find(docs, "StatefulSet", "trainer")
    container = sts["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["torchrun"]
    args = container["args"]
    assert args[-3:] == ["-m", "services", "trainer"]
    flags = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
    assert int(flags["nnodes"]) == sts["spec"]["replicas"]
    assert int(flags["nproc-per-node"]) == container["resources"]["limits"]["nvidia.com/gpu"]
    host, port = flags["rdzv-endpoint"].rsplit(":", 1)
    assert host == f"trainer-0.{sts['spec']['serviceName']}"
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    assert flags["rdzv-backend"] == "c10d"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    env = _container_env(docs, container)
    assert env["PLEXRL_DEVICE"] == "cuda"
    assert image_name(container["image"]) == "plexrl-gpu"
    # the ranks of every pod shard the base model; hybrid's shard groups are whole nodes
    settings = load_settings(settings_class("trainer"), None, {}, environ=env)
    assert settings.sharding in ("fsdp", "hybrid")
    if settings.sharding == "hybrid":
        per_node = int(flags["nproc-per-node"])
        world = int(flags["nnodes"]) * per_node
        assert world % (settings.shard_ranks or per_node) == 0


def test_inference_is_a_scalable_deployment(docs: list[tuple[str, dict[str, Any]]]) -> None:
    deployment = _find(docs, "Deployment", "inference")
    assert deployment["spec"]["replicas"] >= 2
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["PLEXRL_ENGINE"]["value"] == "vllm"
    assert env["PLEXRL_REPLICA_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_registry_is_a_single_deployment_replaced_not_rolled(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    registry = _find(docs, "Deployment", "registry")
    assert registry["spec"]["replicas"] == 1
    assert registry["spec"]["strategy"]["type"] == "Recreate"


def test_runs_config_map_holds_the_demo_runs_verbatim(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    data = _find(docs, "ConfigMap", "plexrl-runs")["data"]
    assert sorted(data) == sorted(p.name for p in RUNS.glob("*.toml"))
    for key, text in data.items():
        assert text == (RUNS / key).read_text(encoding="utf-8"), key
        assert parse_orch_config(text).env == Path(key).stem


def test_one_orchestrator_job_per_run(docs: list[tuple[str, dict[str, Any]]]) -> None:
    data = _find(docs, "ConfigMap", "plexrl-runs")["data"]
    configs = set()
    for job in _of_kind(docs, "Job"):
        pod = job["spec"]["template"]["spec"]
        assert pod["restartPolicy"] == "Never"
        container = pod["containers"][0]
        args = container["args"]
        assert args[0] == "orchestrator"
        run_id = validate_run_id(args[1])
        assert job["metadata"]["labels"]["plexrl.io/run-id"] == run_id
        assert args[2] == "--config"
        mount = next(m for m in container["volumeMounts"] if m["name"] == "runs")
        path = Path(args[3])
        assert str(path.parent) == mount["mountPath"]
        assert path.name in data
        configs.add(path.name)
        rule = job["spec"]["podFailurePolicy"]["rules"][0]
        assert rule["action"] == "FailJob"
        assert rule["onExitCodes"] == {
            "containerName": container["name"],
            "operator": "In",
            "values": [2, 3],
        }
    assert configs == set(data)


def test_nats_cluster_routes_name_every_server(docs: list[tuple[str, dict[str, Any]]]) -> None:
    sts = _find(docs, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    headless = sts["spec"]["serviceName"]
    conf = _find(docs, "ConfigMap", "nats-config")["data"]["nats.conf"]
    routes = re.findall(r"nats://([\w.-]+):(\d+)", conf)
    assert routes == [(f"nats-{i}.{headless}", "6222") for i in range(3)]
    ports = {p["name"]: p["port"] for p in _find(docs, "Service", headless)["spec"]["ports"]}
    assert ports == {"client": 4222, "cluster": 6222, "monitor": 8222}
    claim = sts["spec"]["volumeClaimTemplates"][0]
    mounts = {
        m["name"]: m["mountPath"]
        for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert "store_dir: /data" in conf
    assert "sync_interval: always" in conf


def test_every_plexrl_container_is_probed_with_plexrl_health(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    """Startup, readiness and liveness probes run ``plexrl health <service>`` (the gateway's
    readiness is its HTTP /healthz, since a Service routes clients to it)."""
    for workload, command, container in _plexrl_containers(docs):
        env = _container_env(docs, container)
        check = ["plexrl", "health", env.get("PLEXRL_SERVICE", command)]
        kinds = ("startupProbe", "livenessProbe", "readinessProbe")
        probes = {kind: container.get(kind) for kind in kinds}
        assert all(probes.values()), f"{workload} lacks a probe: {probes}"
        for kind, probe in probes.items():
            if kind == "readinessProbe" and command == "gateway":
                assert probe["httpGet"] == {"path": "/healthz", "port": "http"}
                continue
            assert probe["exec"]["command"] == check, (workload, kind)
            # the check waits up to 3 s for the answer, after starting Python and connecting
            assert probe["timeoutSeconds"] >= 10, (workload, kind)
        liveness, startup = probes["livenessProbe"], probes["startupProbe"]
        assert "initialDelaySeconds" not in liveness, workload  # the startup probe waits
        patience = startup["periodSeconds"] * startup["failureThreshold"]
        assert patience >= 180, workload
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 60, workload


def test_k8s_probes_run_the_compose_health_checks(
    docs: list[tuple[str, dict[str, Any]]],
) -> None:
    compose = yaml.safe_load((K8S.parent / "local.yml").read_text(encoding="utf-8"))
    by_command = {}
    for svc in compose["services"].values():
        argv = list(svc.get("entrypoint") or ["plexrl"]) + list(svc.get("command") or [])
        test = (svc.get("healthcheck") or {}).get("test")
        if argv[0] == "plexrl" and test:
            by_command[argv[1]] = test
    for workload, command, container in _plexrl_containers(docs):
        assert by_command[command] == ["CMD", *container["livenessProbe"]["exec"]["command"]], (
            workload
        )
