"""The first connection to NATS: services wait for a server that is not up yet, with backoff;
client commands and refused credentials fail at once, with the same clear errors as before."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas import subjects as sj
from services.bus import Bus, BusUnavailable, EmbeddedNats, free_port

REPO = Path(__file__).resolve().parents[2]


def _waits(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for NATS" in r.getMessage()]


async def test_connect_waits_for_a_server_that_starts_later(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.bus.bus")
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=free_port())

    async def start_later() -> None:
        await asyncio.sleep(2.0)
        await asyncio.to_thread(server.start)

    starter = asyncio.create_task(start_later())
    try:
        bus = await Bus.connect(server.url, "trainer", wait=60.0)
        try:
            assert bus.nc.is_connected
            # provisioned once connected: the streams are there
            assert (await bus.js.stream_info(sj.RUNS_STREAM)).config.name == sj.RUNS_STREAM
        finally:
            await bus.close()
        await starter
        waits = _waits(caplog)
        assert len(waits) >= 2, waits
        assert f"waiting for NATS at {server.url} (attempt 1," in waits[0]
        assert "(attempt 2," in waits[1]
    finally:
        starter.cancel()
        server.close()


async def test_without_wait_nothing_listening_fails_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(BusUnavailable, match=r"cannot reach NATS at .*nothing accepts connections"):
        await Bus.connect(url, "cli")
    assert _waits(caplog) == []


async def test_a_bounded_wait_gives_up_with_the_clear_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="services.bus.bus")
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(BusUnavailable, match=r"cannot reach NATS at .*plexrl up"):
        await Bus.connect(url, "registry", wait=0.6)
    waits = _waits(caplog)
    assert len(waits) >= 2, waits  # 0.25 s, then 0.35 s (what is left of 0.6)


async def test_refused_credentials_are_not_retried(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services.bus.bus")
    auth = "authorization {\n  user: plexrl\n  password: right\n}\n"
    with EmbeddedNats(store_dir=tmp_path / "nats", extra_config=auth) as server:
        url = server.url.replace("nats://", "nats://plexrl:wrong@")
        with pytest.raises(BusUnavailable, match="authorization violation"):
            await Bus.connect(url, "trainer", wait=600.0)
    assert _waits(caplog) == []


def _plexrl(*argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "services", *argv],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


async def test_a_service_process_waits_a_client_command_does_not(tmp_path: Path) -> None:
    server = EmbeddedNats(store_dir=tmp_path / "nats", port=free_port())
    env = {"PLEXRL_NATS_URL": server.url, "PLEXRL_CONNECT_WAIT_S": "120"}
    client = _plexrl("runs", env=env)
    out, _ = await asyncio.to_thread(client.communicate, timeout=60)
    assert client.returncode == 1, out
    assert f"plexrl runs: cannot reach NATS at {server.url}" in out

    registry = _plexrl(
        "registry", "--output-dir", str(tmp_path / "out"), "--max-runs", "2", env=env
    )
    try:
        await asyncio.sleep(2.0)
        assert registry.poll() is None, registry.stdout.read() if registry.stdout else ""
        server.start()
        # once connected the registry serves the run list: `plexrl runs` answers
        for _ in range(120):
            listing = _plexrl("runs", env=env)
            text, _ = await asyncio.to_thread(listing.communicate, timeout=60)
            if listing.returncode == 0:
                break
            await asyncio.sleep(0.5)
        assert listing.returncode == 0, text
        assert registry.poll() is None
    finally:
        registry.terminate()
        out, _ = await asyncio.to_thread(registry.communicate, timeout=30)
        server.close()
    assert registry.returncode == 0, out
    assert "waiting for NATS at" in out and "(attempt 1," in out
