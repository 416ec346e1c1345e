"""Fixtures of the inference tests: the tiny model (built once) and replicas on the session's
nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from inference_support import LORA_TARGETS

from services.bus import Bus
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine
from services.model.loader import load_model
from services.model.lora import MultiLoRA
from services.model.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("inference-tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def scratch_lora(tiny_dir: Path) -> tuple[Any, MultiLoRA]:
    """A separate tiny model whose slots make adapters and reference generations."""
    model, _ = load_model(tiny_dir)
    return model, MultiLoRA.attach(model, n_adapters=4, max_rank=8)


@pytest.fixture
async def start_replica(
    nats_url: str, tiny_dir: Path, tmp_path: Path
) -> AsyncIterator[Callable[..., Awaitable[InferenceService]]]:
    """Start inference replicas (own connection, torch engine on the tiny model) for one test."""
    started: list[tuple[InferenceService, Bus]] = []

    async def start(name: str = "replica-a", max_runs: int = 4, **engine: Any) -> InferenceService:
        bus = await Bus.connect(nats_url, "inference")
        options = {"batch_window_ms": 5.0, "max_batch_tokens": 16384} | engine
        torch_engine = TorchEngine(
            tiny_dir, max_runs=max_runs, max_lora_rank=8, target_modules=LORA_TARGETS, **options
        )
        service = InferenceService(
            bus, torch_engine, max_runs=max_runs, replica_name=name, output_dir=tmp_path
        )
        await service.start()
        started.append((service, bus))
        return service

    yield start
    for service, bus in started:
        await service.stop()
        await bus.close()
