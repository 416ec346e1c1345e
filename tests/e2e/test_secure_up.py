"""``plexrl up`` against a nats-server with authentication and TLS on, as a deployment runs it.

The server's config comes from ``plexrl tenants add`` and ``plexrl nats-config --tls-...``; the
services connect with their own nkey (``PLEXRL_NATS_CREDS``) and trust the test's CA
(``PLEXRL_TLS_CA``). A client without the CA, or without a key the server knows, gets nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pki import Pki, make_pki

from services.bus import find_nats_server, free_port
from services.model.tiny import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _plexrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Pki]]:
    root = tmp_path_factory.mktemp("secure")
    pki = make_pki(root)
    auth = root / "auth"
    added = _plexrl("tenants", "add", "team-a", "--max-runs", "2", "--dir", str(auth))
    assert added.returncode == 0, added.stderr
    port = free_port()
    config = _plexrl(
        "nats-config",
        *("--dir", str(auth), "--listen", f"127.0.0.1:{port}"),
        *("--store-dir", str(root / "store")),
        *("--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key)),
    )
    assert config.returncode == 0, config.stderr
    log = open(root / "nats.log", "wb")  # noqa: SIM115 - lives with the process
    proc = subprocess.Popen(
        [find_nats_server(), "-c", str(auth / "nats.conf")], stdout=log, stderr=log
    )
    try:
        yield f"nats://127.0.0.1:{port}", auth, pki
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLEXRL_", "OTEL_"))}
    env.update(extra)
    return env


def test_plexrl_up_trains_over_tls_with_the_services_key(
    secure_server: tuple[str, Path, Pki], tmp_path: Path
) -> None:
    url, auth, pki = secure_server
    model = build_tiny_model(tmp_path / "model", seed=0)
    env = _env(PLEXRL_NATS_CREDS=str(auth / "services.nk"), PLEXRL_TLS_CA=str(pki.ca))
    up = _plexrl(
        *("up", "--runs", "1", "--steps", "3", "--nats-url", url, "--model", str(model)),
        *("--output-dir", str(tmp_path / "out"), "--no-live"),
        env=env,
    )
    assert up.returncode == 0, f"plexrl up failed:\n{up.stdout}\n{up.stderr}"
    run_dir = next((tmp_path / "out").glob("run_*"))
    steps = [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [0, 1, 2]
    listed = _plexrl("runs", "--json", "--nats-url", url, env=env)
    assert listed.returncode == 0, listed.stderr
    assert run_dir.name in listed.stdout


def test_a_client_without_the_ca_is_refused(secure_server: tuple[str, Path, Pki]) -> None:
    url, auth, _ = secure_server
    listed = _plexrl(
        "runs", "--nats-url", url, env=_env(PLEXRL_NATS_CREDS=str(auth / "services.nk"))
    )
    assert listed.returncode != 0
    assert "certificate verify failed" in listed.stderr


def test_a_client_without_a_known_key_is_refused(
    secure_server: tuple[str, Path, Pki], tmp_path: Path
) -> None:
    url, _, pki = secure_server
    listed = _plexrl("runs", "--nats-url", url, env=_env(PLEXRL_TLS_CA=str(pki.ca)))
    assert listed.returncode != 0
    assert "authorization violation" in listed.stderr.lower()


def test_a_tenant_lists_only_what_is_its_own(
    secure_server: tuple[str, Path, Pki], tmp_path: Path
) -> None:
    url, auth, pki = secure_server
    env = _env(
        PLEXRL_NATS_CREDS=str(auth / "team-a.nk"), PLEXRL_TLS_CA=str(pki.ca), PLEXRL_TENANT="team-a"
    )
    # A tenant's runs come from the registry's list service: none is running yet.
    listed = _plexrl("runs", "--json", "--nats-url", url, env=env)
    assert listed.returncode == 1
    assert "no registry answered on plexrl.registry.team-a.list" in listed.stderr
    services = _env(PLEXRL_NATS_CREDS=str(auth / "services.nk"), PLEXRL_TLS_CA=str(pki.ca))
    registry = subprocess.Popen(
        [sys.executable, "-m", "services", "registry", "--nats-url", url],
        env={**services, "PLEXRL_OUTPUT_DIR": str(tmp_path / "out")},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            listed = _plexrl("runs", "--json", "--nats-url", url, env=env)
            if listed.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.strip() == ""
        # a run of the default tenant: the services see it, team-a does not
        config = tmp_path / "orch.toml"
        config.write_text('env = "reverse"\n')
        submitted = _plexrl("submit", "run_theirs", str(config), "--nats-url", url, env=services)
        assert submitted.returncode == 0, submitted.stderr
        everything = _plexrl("runs", "--json", "--nats-url", url, env=services)
        assert "run_theirs" in everything.stdout
        listed = _plexrl("runs", "--json", "--nats-url", url, env=env)
        assert listed.returncode == 0 and "run_theirs" not in listed.stdout
    finally:
        registry.terminate()
        registry.wait(timeout=30)
