"""Fixtures of the run-state tests: a dedicated nats-server per test, so a test can count the
events on PLEXRL_RUNS without filtering out other tests' traffic."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from services.bus import Bus, EmbeddedNats


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(store_dir=tmp_path / "nats") as s:
        yield s


@pytest.fixture
async def rbus(server: EmbeddedNats) -> AsyncIterator[Bus]:
    b = await Bus.connect(server.url, "test")
    yield b
    await b.close()
