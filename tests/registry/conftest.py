"""Fixtures of the registry tests, on the nats-server of their own (``server``, tests/conftest.py).

Each registry test gets its own ``nats-server`` (about 30 ms to start): the run table, the
durable consumers and the lifecycle stream are then exactly what that test made, so a test can
count events without filtering out other tests' traffic. ``make_registry`` starts registries
on it (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from services.bus import Bus, EmbeddedNats
from services.registry.service import Registry


@pytest.fixture
async def rbus(server: EmbeddedNats) -> AsyncIterator[Bus]:
    b = await Bus.connect(server.url, "test")
    yield b
    await b.close()


RegistryFactory = Callable[..., Awaitable[Registry]]
