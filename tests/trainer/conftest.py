"""Fixtures of the trainer tests: the tiny model, built once, and a NATS server per service test.

Service tests get their own server: each runs a registry, whose run table (KV plexrl-registry)
and index pool must not see the runs of another test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch

from services.bus import Bus, EmbeddedNats
from services.model.tiny import build_tiny_model

# The tests measure behaviour, not speed; two threads keep a 2-core machine responsive while
# subprocess trainers run beside the test process.
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=tmp_path / "jetstream")
    server.start()
    yield server
    server.close()


@pytest.fixture
async def own_bus(own_nats: EmbeddedNats) -> AsyncIterator[Bus]:
    bus = await Bus.connect(own_nats.url, "test")
    yield bus
    await bus.close()
