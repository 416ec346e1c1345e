"""Fixtures of the registry tests: a dedicated nats-server per test, and registries on it.

Each registry test gets its own ``nats-server`` (about 30 ms to start): the run table, the
durable consumers and the lifecycle stream are then exactly what that test made, so a test can
count events without filtering out other tests' traffic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.bus import Bus, EmbeddedNats
from services.registry.service import Registry
from services.registry.settings import RegistrySettings


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(store_dir=tmp_path / "nats") as s:
        yield s


@pytest.fixture
async def rbus(server: EmbeddedNats) -> AsyncIterator[Bus]:
    b = await Bus.connect(server.url, "test")
    yield b
    await b.close()


@pytest.fixture
def out(tmp_path: Path) -> Path:
    d = tmp_path / "out"
    d.mkdir()
    return d


RegistryFactory = Callable[..., Awaitable[Registry]]


@pytest.fixture
async def make_registry(server: EmbeddedNats, out: Path) -> AsyncIterator[RegistryFactory]:
    """Start registries (each on its own connection, service 'registry'); stopped at the end."""
    started: list[tuple[Registry, Bus]] = []

    async def make(**overrides: Any) -> Registry:
        # Scans are driven by the tests (registry.scan()) unless a test asks for a short interval.
        settings = RegistrySettings(
            **({"output_dir": out, "max_runs": 4, "scan_interval": 3600.0} | overrides)
        )
        bus = await Bus.connect(server.url, settings.service)
        registry = Registry(bus, settings)
        await registry.start()
        started.append((registry, bus))
        return registry

    yield make
    for registry, bus in started:
        await registry.stop()
        await bus.close()
