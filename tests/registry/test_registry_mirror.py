"""A real registry feeds the run mirror: eviction requests from the mirror free an index."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.bus import Bus
from services.runs import RunMirror

from .conftest import RegistryFactory
from .helpers import eventually, write_orch


@pytest.fixture
async def mirror(rbus: Bus) -> AsyncIterator[RunMirror]:
    m = RunMirror(rbus, max_runs=4, service="trainer")
    await m.start()
    yield m
    await m.stop()


async def test_mirror_follows_a_real_registry(
    make_registry: RegistryFactory, rbus: Bus, mirror: RunMirror, out: Path
) -> None:
    for run_id in ("run_a", "run_b", "run_c"):
        write_orch(out, run_id)
    registry = await make_registry(max_runs=2)
    created: list[tuple[int, str]] = []
    deleted: list[tuple[int, str]] = []
    mirror.register_creation_hook(lambda i, r: created.append((i, r)))
    mirror.register_deletion_hook(lambda i, r: deleted.append((i, r)))
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    assert created == [(0, "run_a"), (1, "run_b")]

    await mirror.evict_run(0, "bad data")
    await eventually(lambda: _has_index(registry.idx_of("run_c")))
    await mirror.wait_until_caught_up()
    await mirror.synchronize_state()
    assert deleted == [(0, "run_a")] and created[-1] == (0, "run_c")
    assert {i: r.run_id for i, r in mirror.runs.items()} == registry.pool.assigned


async def _has_index(idx: int | None) -> bool:
    return idx is not None
