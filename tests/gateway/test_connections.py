"""The gateway's connections under abuse: idle sockets are closed by timeouts while normal
requests are served, a flood past the cap is refused at once, and a client that leaves
mid-body costs no traceback in the log."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gateway_support import REPO, free_port

from services.bus import EmbeddedNats
from services.model.tiny import build_tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """A nats-server and the tiny model: all a gateway needs to serve its connections."""
    root = tmp_path_factory.mktemp("connections")
    with EmbeddedNats(store_dir=root / "nats") as server:
        yield server.url, build_tiny_model(root / "model", seed=0)


def _gateway(base, tmp_path_factory, *flags: str) -> Iterator[tuple[str, Path]]:
    """A gateway on ``base``, with ``flags``."""
    nats_url, model = base
    port = free_port()
    log = tmp_path_factory.mktemp("guarded") / "gateway.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLEXRL_")}
    env |= {"PLEXRL_NATS_URL": nats_url}
    argv = ["gateway", "--model", str(model), "--port", str(port), *flags]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services", *argv], cwd=REPO, env=env, stdout=sink, stderr=sink
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield url, log
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def guarded(base, tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """Short timeouts, a cap above the test's thousand sockets."""
    yield from _gateway(
        base,
        tmp_path_factory,
        *("--service", "gw-guard", "--header-timeout-s", "1", "--body-timeout-s", "2"),
        *("--max-connections", "1100"),
    )


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed ``sock`` (a read returns nothing, or the reset)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except (BlockingIOError, TimeoutError):
        return False


def test_a_thousand_idle_connections_are_closed_while_requests_are_served(guarded) -> None:
    url, log = guarded
    port = int(url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
    try:
        # served while the idle sockets are open
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        for s in idle:
            s.settimeout(30)
        assert sum(_closed(s) for s in idle) == 1000  # each closed by the head timeout
        assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    finally:
        for s in idle:
            s.close()
    assert "no request head in time" in log.read_text()


def test_a_client_that_leaves_mid_body_logs_no_traceback(guarded) -> None:
    url, log = guarded
    port = int(url.rsplit(":", 1)[1])
    before = log.read_text()
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 5000\r\n\r\n" + b'{"model": "' + b"x" * 100
            )
    # a slow body gets a 408 in the API's own shape
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
        s.settimeout(30)
        answer = b""
        while b"}}" not in answer and (chunk := s.recv(4096)):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 2s" in answer
    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
    written = log.read_text()[len(before) :]
    assert "Traceback" not in written and "ERROR" not in written, written


def test_connections_past_the_cap_are_refused_at_once_and_room_comes_back(
    base, tmp_path_factory
) -> None:
    for url, log in _gateway(
        base,
        tmp_path_factory,
        *("--service", "gw-cap", "--max-connections", "32", "--header-timeout-s", "120"),
    ):
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        try:
            # no head timeout can fire in this test (120 s): every close is the cap's
            deadline = time.monotonic() + 30
            closed: list[socket.socket] = []
            while len(closed) < 8 and time.monotonic() < deadline:
                ready, _, _ = select.select([s for s in held if s not in closed], [], [], 0.5)
                closed += [s for s in ready if _closed(s)]
            assert len(closed) == 8
            ready, _, _ = select.select([s for s in held if s not in closed], [], [], 1.0)
            assert ready == []  # and no more than those past the cap
            for s in held[:10]:
                s.close()
            time.sleep(0.5)  # the server sees the closes
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        finally:
            for s in held:
                s.close()
        assert "connections refused at the cap" in log.read_text()
