"""Fixtures and options of the fault suite: the tiny model, the seed, ``--soak SECONDS``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from services.model.tiny import build_tiny_model


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("plexrl faults")
    group.addoption(
        "--soak",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="run randomized fault scenarios, with the same checks, for this long (0: skip)",
    )
    group.addoption(
        "--fault-seed",
        type=int,
        default=None,
        metavar="N",
        help="seed of the fault schedules (default: a fresh one, printed; pass it to reproduce)",
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("faults-tiny") / "model", seed=0)


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> random.Random:
    """The scenario's RNG; its seed is printed (pytest shows it with a failure) to reproduce it."""
    seed = request.config.getoption("--fault-seed")
    if seed is None:
        seed = random.SystemRandom().randrange(2**32)
    print(f"fault seed {seed} (reproduce with --fault-seed {seed})", flush=True)
    return random.Random(seed)


@pytest.fixture
def soak_seconds(request: pytest.FixtureRequest) -> float:
    return float(request.config.getoption("--soak"))
