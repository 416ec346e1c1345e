"""deploy/healthcheck.py, the image's HEALTHCHECK: healthy only while NATS greets it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from services.bus.server import free_port

from .contract import DEPLOY, healthcheck_module

NATS_GREETING = b'INFO {"server_id":"fake","version":"2.10.0","max_payload":8388608}\r\n'


@pytest.fixture(scope="module")
def hc() -> ModuleType:
    return healthcheck_module()


@pytest.fixture
def greeter() -> Iterator[Callable[[bytes], int]]:
    """Start loopback servers that send ``greeting`` to each client; returns their port."""
    sockets: list[socket.socket] = []

    def start(greeting: bytes) -> int:
        server = socket.create_server(("127.0.0.1", 0))
        sockets.append(server)

        def serve() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(greeting)

        threading.Thread(target=serve, daemon=True).start()
        return int(server.getsockname()[1])

    yield start
    for s in sockets:
        s.close()


def test_parses_nats_url_lists(hc: ModuleType) -> None:
    assert hc.nats_addresses("nats://nats:4222") == [("nats", 4222)]
    assert hc.nats_addresses("nats://a:1, nats://user:pw@b ,c:7,") == [
        ("a", 1),
        ("b", 4222),
        ("c", 7),
    ]
    assert hc.nats_addresses("tls://nats-0.nats-headless:4222") == [("nats-0.nats-headless", 4222)]


def test_healthy_when_a_nats_server_greets(hc: ModuleType, greeter: Callable[[bytes], int]) -> None:
    port = greeter(NATS_GREETING)
    ok, message = hc.check({"PLEXRL_NATS_URL": f"nats://127.0.0.1:{port}"})
    assert ok, message
    assert message == f"healthy: NATS answers at nats://127.0.0.1:{port}"


def test_healthy_against_a_real_nats_server(hc: ModuleType, nats_url: str) -> None:
    ok, message = hc.check({"PLEXRL_NATS_URL": nats_url})
    assert ok, message


def test_unhealthy_when_nothing_listens(hc: ModuleType) -> None:
    port = free_port()
    ok, message = hc.check({"PLEXRL_NATS_URL": f"nats://127.0.0.1:{port}"})
    assert not ok
    assert f"127.0.0.1:{port}" in message
    assert message.startswith("unhealthy: no NATS server")


def test_unhealthy_when_the_port_is_not_nats(
    hc: ModuleType, greeter: Callable[[bytes], int]
) -> None:
    port = greeter(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    ok, message = hc.check({"PLEXRL_NATS_URL": f"nats://127.0.0.1:{port}"})
    assert not ok
    assert "not a NATS server" in message


def test_any_server_of_a_cluster_list_will_do(
    hc: ModuleType, greeter: Callable[[bytes], int]
) -> None:
    dead, alive = free_port(), greeter(NATS_GREETING)
    ok, message = hc.check({"PLEXRL_NATS_URL": f"nats://127.0.0.1:{dead},127.0.0.1:{alive}"})
    assert ok, message


def test_heartbeat_file_must_be_fresh(
    hc: ModuleType, greeter: Callable[[bytes], int], tmp_path: Path
) -> None:
    env = {"PLEXRL_NATS_URL": f"nats://127.0.0.1:{greeter(NATS_GREETING)}"}
    beat = tmp_path / "heartbeat"

    ok, message = hc.check({**env, "PLEXRL_HEALTH_FILE": str(beat)})
    assert not ok
    assert "heartbeat file" in message and "No such file" in message

    beat.touch()
    assert hc.check({**env, "PLEXRL_HEALTH_FILE": str(beat)})[0]

    old = time.time() - 300
    os.utime(beat, (old, old))
    ok, message = hc.check({**env, "PLEXRL_HEALTH_FILE": str(beat)})
    assert not ok
    assert "limit 120 s" in message
    ok, _ = hc.check({**env, "PLEXRL_HEALTH_FILE": str(beat), "PLEXRL_HEALTH_MAX_AGE": "600"})
    assert ok
    ok, message = hc.check({**env, "PLEXRL_HEALTH_FILE": str(beat), "PLEXRL_HEALTH_MAX_AGE": "x"})
    assert not ok
    assert "PLEXRL_HEALTH_MAX_AGE" in message


def test_exit_status_is_what_docker_reads(greeter: Callable[[bytes], int]) -> None:
    script = str(DEPLOY / "healthcheck.py")
    base = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}

    def run(url: str) -> subprocess.CompletedProcess[str]:
        env = {**base, "PLEXRL_NATS_URL": url}
        return subprocess.run(
            [sys.executable, script], env=env, capture_output=True, text=True, timeout=30
        )

    good = run(f"nats://127.0.0.1:{greeter(NATS_GREETING)}")
    assert good.returncode == 0
    assert good.stdout.startswith("healthy:")
    bad = run(f"nats://127.0.0.1:{free_port()}")
    assert bad.returncode == 1
    assert bad.stdout.startswith("unhealthy:")
