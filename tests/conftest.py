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
# Without a GPU, Triton runs in its interpreter, which must be chosen before anything (transformers
# does) imports triton; plexrl's CPU work takes that path only where a test sets
# services.model.triton_kernels.CPU_INTERPRETER.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


PauseCounts = Callable[[str], dict[tuple[str, str], int]]


@pytest.fixture
def pause_metrics(monkeypatch: pytest.MonkeyPatch) -> PauseCounts:
    """The paused-operations instruments (``plexrl_paused_operations``, ``plexrl_pauses``),
    recorded into a reader of the test's own; call the result with a metric's name for its
    values by (reason, store)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from services.telemetry import metrics as telemetry

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    monkeypatch.setattr(
        telemetry, "PAUSED_OPERATIONS", meter.create_up_down_counter("plexrl_paused_operations")
    )
    monkeypatch.setattr(telemetry, "PAUSES", meter.create_counter("plexrl_pauses"))

    def counts(name: str) -> dict[tuple[str, str], int]:
        data = reader.get_metrics_data()
        out: dict[tuple[str, str], int] = {}
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in (m for m in scope.metrics if m.name == name):
                    for p in metric.data.data_points:
                        key = (str(p.attributes["reason"]), str(p.attributes["store"]))
                        out[key] = int(p.value)
        return out

    return counts
