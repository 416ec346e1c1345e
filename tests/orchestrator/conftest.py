"""Fixtures of the orchestrator tests: a nats-server per test, a real registry, a replica
(``server`` and ``make_registry`` come from tests/conftest.py).

Each loop test gets its own ``nats-server`` (about 30 ms to start), so its queue group
``inference`` holds only the replica that test started and the streams hold only its run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from schemas.config import OrchConfig
from services.bus import Bus, EmbeddedNats
from services.model.tiny import build_tiny_model
from services.model.tokenizer import build_char_tokenizer
from services.registry.service import Registry

from .replica import ScriptedReplica

RUN = "run_orch"


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (not pretrained): the tokenizer source and inference's model."""
    return build_tiny_model(tmp_path_factory.mktemp("orch-tiny") / "model", seed=0)


@pytest.fixture
async def obus(server: EmbeddedNats) -> AsyncIterator[Bus]:
    b = await Bus.connect(server.url, "test")
    yield b
    await b.close()


RegistryFactory = Callable[..., Awaitable[Registry]]


@pytest.fixture
async def registry(make_registry: RegistryFactory) -> Registry:
    return await make_registry()


@pytest.fixture
async def replica(server: EmbeddedNats) -> AsyncIterator[ScriptedReplica]:
    rbus = await Bus.connect(server.url, "inference")
    r = await ScriptedReplica(rbus, RUN).start()
    yield r
    await r.stop()
    await rbus.close()


def orch_config(**overrides: Any) -> OrchConfig:
    """A small reverse run: 2 prompts x 2 completions of at most 4 tokens per step."""
    base: dict[str, Any] = {
        "env": "reverse",
        "seed": 7,
        "max_steps": 3,
        "batch_size": 2,
        "group_size": 2,
        "max_async_level": 1,
        "sampling": {"temperature": 1.0, "max_tokens": 4},
        "eval": {"interval": 0},  # these tests count requests; test_eval*.py evaluates
    }
    return OrchConfig.model_validate(base | overrides)
