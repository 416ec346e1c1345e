"""Fixtures of the fuzz tests: a client connection on the test's own nats-server, and the tiny
model the trainer and inference load."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.bus import Bus, EmbeddedNats
from services.model.tiny import build_tiny_model


@pytest.fixture
async def fbus(server: EmbeddedNats) -> AsyncIterator[Bus]:
    """The fuzzer's connection: it publishes and requests the payloads."""
    b = await Bus.connect(server.url, "fuzz")
    yield b
    await b.close()


@pytest.fixture(scope="session")
def fuzz_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("fuzz-tiny") / "model", seed=0)
