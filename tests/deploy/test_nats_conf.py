"""deploy/nats.conf and the cluster config in deploy/k8s/nats.yaml, checked by nats-server itself
(``nats-server -t``: parse the config and exit)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

from services.bus.server import MAX_PAYLOAD, find_nats_server

from .contract import DEPLOY, K8S

NATS_CONF = DEPLOY / "nats.conf"


def _test_config(path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "POD_NAME"} | env
    return subprocess.run(
        [find_nats_server(), "-t", "-c", str(path)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=30,
    )


def _k8s_conf() -> str:
    docs = yaml.safe_load_all((K8S / "nats.yaml").read_text(encoding="utf-8"))
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    return str(config_map["data"]["nats.conf"])


def _settings(text: str) -> dict[str, str]:
    """``key: value`` lines (blocks flattened, the first of a key wins), comments dropped."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        m = re.fullmatch(r"(\w+)\s*:\s*(.+)", line)
        if m:
            out.setdefault(m.group(1), m.group(2).strip())
    return out


def test_local_config_keeps_jetstream_durable() -> None:
    text = NATS_CONF.read_text(encoding="utf-8")
    assert re.search(r"^jetstream\s*\{", text, re.MULTILINE)
    settings = _settings(text)
    assert settings["store_dir"] == "/data"
    assert settings["sync_interval"] == "always"
    assert settings["http_port"] == "8222"
    assert settings["port"] == "4222"
    assert settings["max_payload"] == f"{MAX_PAYLOAD // (1024 * 1024)}MB"


def test_nats_server_accepts_the_local_config() -> None:
    result = _test_config(NATS_CONF)
    assert result.returncode == 0, result.stderr
    assert "is valid" in result.stderr + result.stdout


def test_nats_server_rejects_a_broken_config(tmp_path: Path) -> None:
    broken = tmp_path / "nats.conf"
    broken.write_text(
        NATS_CONF.read_text(encoding="utf-8").replace("sync_interval:", "sync_intervall:"),
        encoding="utf-8",
    )
    result = _test_config(broken)
    assert result.returncode != 0
    assert "sync_intervall" in result.stderr


def test_cluster_config_is_valid_for_each_server(tmp_path: Path) -> None:
    path = tmp_path / "nats.conf"
    path.write_text(_k8s_conf(), encoding="utf-8")
    result = _test_config(path, POD_NAME="nats-0")
    assert result.returncode == 0, result.stderr
    # server_name comes from the pod's name: without it the server refuses to start
    assert _test_config(path).returncode != 0


def test_cluster_config_matches_the_local_one() -> None:
    local, cluster = _settings(NATS_CONF.read_text(encoding="utf-8")), _settings(_k8s_conf())
    for key in ("port", "http_port", "max_payload", "store_dir", "sync_interval"):
        assert cluster[key] == local[key], key
    assert cluster["server_name"] == "$POD_NAME"
    assert cluster["name"] == "plexrl"
    assert cluster["port"] == "4222"
    assert re.search(r"cluster\s*\{[^}]*port:\s*6222", _k8s_conf())
