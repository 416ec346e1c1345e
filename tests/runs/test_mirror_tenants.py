"""The run mirror with tenants: both subject forms, each run's tenant, forged tenants refused."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from schemas import subjects as sj
from schemas.config import OrchConfig
from schemas.events import RunDiscovered, RunEvicted, RunForgotten
from schemas.records import Progress, RunRecord
from schemas.tenant import InvalidTenant
from services.bus import Bus
from services.runs import RunMirror, read_progress, write_progress
from services.runs.mirror import is_lifecycle_subject

CONFIG = OrchConfig(env="copy", max_steps=7)


@pytest.fixture
async def mirror(rbus: Bus) -> AsyncIterator[RunMirror]:
    m = RunMirror(rbus, max_runs=4, service="trainer")
    await m.start()
    yield m
    await m.stop()


def _record(run_id: str, idx: int, tenant: str) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        status="active",
        idx=idx,
        config=CONFIG.to_dict(),
        config_digest=CONFIG.digest(),
        tenant=tenant,
    )


async def _announce(bus: Bus, record: RunRecord) -> None:
    owed = record.lifecycle_event()
    assert owed is not None
    subject, msg_id, event = owed
    await bus.publish(subject, event, msg_id=msg_id)


def test_lifecycle_subjects_of_both_forms() -> None:
    assert is_lifecycle_subject("plexrl.runs.discovered")
    assert is_lifecycle_subject("plexrl.runs.acme.evicted")
    assert is_lifecycle_subject("plexrl.runs.acme.forgotten")
    for other in (
        "plexrl.runs.submit",
        "plexrl.runs.acme.submit",
        "plexrl.runs.acme.invalid",
        "plexrl.runs.run_x.discovered",  # not a tenant name
        "plexrl.runs.a.b.discovered",
        "plexrl.rollouts.acme.discovered",
    ):
        assert not is_lifecycle_subject(other), other


async def test_tenant_runs_are_mirrored_with_their_tenant(rbus: Bus, mirror: RunMirror) -> None:
    created: list[tuple[int, str]] = []
    deleted: list[tuple[int, str]] = []
    mirror.register_creation_hook(lambda i, r: created.append((i, r)))
    mirror.register_deletion_hook(lambda i, r: deleted.append((i, r)))
    await _announce(rbus, _record("run_a", 0, "acme"))
    await _announce(rbus, _record("run_b", 1, "beta"))
    await _announce(rbus, _record("run_c", 2, "default"))
    await mirror.wait_until_caught_up()
    assert await mirror.synchronize_state() == 3
    assert created == [(0, "run_a"), (1, "run_b"), (2, "run_c")]
    assert [(mirror.tenant_of(r), mirror.runs[i].tenant) for i, r in created] == [
        ("acme", "acme"),
        ("beta", "beta"),
        ("default", "default"),
    ]
    assert mirror.tenant_of("run_nobody") is None

    evicted = _record("run_a", 0, "acme").next("evicted", idx=None, released_idx=0, reason="x")
    await _announce(rbus, evicted)
    await rbus.publish(
        sj.runs_subject("forgotten", "beta"), RunForgotten(run_id="run_b", idx=1, tenant="beta")
    )
    await mirror.wait_until_caught_up()
    assert await mirror.synchronize_state() == 2
    assert deleted == [(0, "run_a"), (1, "run_b")]
    assert mirror.tenant_of("run_a") is None and list(mirror.runs) == [2]


async def test_an_event_whose_tenant_is_not_its_subjects_is_reported_and_skipped(
    rbus: Bus, mirror: RunMirror
) -> None:
    before = rbus.invalid_count
    # acme's subject, beta's run: whoever could publish there cannot speak for beta
    forged = RunDiscovered(
        run_id="run_b", idx=1, config=CONFIG.to_dict(), config_digest="", tenant="beta"
    )
    await rbus.publish(sj.runs_subject("discovered", "acme"), forged)
    await rbus.publish(
        sj.runs_subject("evicted"), RunEvicted(run_id="run_c", idx=2, reason="x", tenant="acme")
    )
    await _announce(rbus, _record("run_b", 1, "beta"))
    await mirror.wait_until_caught_up()
    assert await mirror.synchronize_state() == 1
    assert mirror.tenant_of("run_b") == "beta" and rbus.invalid_count == before + 2


async def test_progress_carries_the_tenant_and_refuses_a_bad_one(rbus: Bus) -> None:
    await write_progress(
        rbus, "run_a", Progress(step=2, total_tokens=9, total_samples=3, tenant="acme")
    )
    progress = await read_progress(rbus, "run_a")
    assert progress is not None and (progress.step, progress.tenant) == (2, "acme")
    with pytest.raises(InvalidTenant, match=r"illegal tenant name 'a\.b'"):
        await write_progress(
            rbus, "run_a", Progress(step=3, total_tokens=9, total_samples=3, tenant="a.b")
        )
    progress = await read_progress(rbus, "run_a")
    assert progress is not None and progress.step == 2  # the bad write left the record alone
