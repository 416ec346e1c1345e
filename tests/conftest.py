"""Shared fixtures: one real nats-server with JetStream for the whole session."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

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
