"""Shared fixtures: real nats-servers with JetStream (one for the session, or one per test)
and registries started on the per-test one."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from services.bus import Bus, EmbeddedNats


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=tmp_path_factory.mktemp("jetstream"))
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, "test")
    yield b
    await b.close()


@pytest.fixture
def uid() -> str:
    """A short unique token so tests sharing the session server never share subjects."""
    return uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server of this test's own (about 30 ms to start): its streams, consumers and
    queue groups hold only what the test made."""
    with EmbeddedNats(store_dir=tmp_path / "nats") as s:
        yield s


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """The output directory (run directories) of this test."""
    d = tmp_path / "out"
    d.mkdir()
    return d


RegistryFactory = Callable[..., Awaitable[Any]]


@pytest.fixture
async def make_registry(server: EmbeddedNats, out: Path) -> AsyncIterator[RegistryFactory]:
    """Start registries on ``server``, each on its own connection; stopped at the end.

    Scans are driven by the tests (``registry.scan()``) unless a test asks for a short interval.
    """
    from services.registry.service import Registry
    from services.registry.settings import RegistrySettings

    started: list[tuple[Registry, Bus]] = []

    async def make(**overrides: Any) -> Registry:
        settings = RegistrySettings(
            **({"output_dir": out, "max_runs": 4, "scan_interval": 3600.0} | overrides)
        )
        rbus = await Bus.connect(server.url, settings.service)
        registry = Registry(rbus, settings)
        await registry.start()
        started.append((registry, rbus))
        return registry

    yield make
    for registry, rbus in started:
        await registry.stop()
        await rbus.close()
