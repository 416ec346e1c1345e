"""The registry's ingest: a tenant's writes, checked before anything is stored, on the accounts of
``plexrl nats-config`` (tests/accounts_support.py) with a real registry in this process.

Each refusal must come back as the publish's error, saying why, with nothing stored; each write
that passes is stored under the tenant's prefixed message id. The registry reads the tenants file
again when it changes and keeps a new tenant's views.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from accounts_support import AccountsBroker, accounts_broker, write_config
from nats.js.errors import APIError

from schemas import subjects as sj
from schemas.events import EvictRequested, RolloutBatch, RunSubmitted
from services.bus import Bus
from services.cli import main
from services.config.tenants import TenantQuota
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.tenants.credentials import SERVICES

CONFIG = {
    "env": "reverse",
    "max_steps": 5,
    "batch_size": 1,
    "group_size": 1,
    "max_async_level": 0,
    "ckpt": {"interval": 1},
}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[AccountsBroker]:
    with accounts_broker(tmp_path, {"acme": TenantQuota(max_run_dirs=2)}) as b:
        yield b


@pytest.fixture
async def registry(broker: AccountsBroker, tmp_path: Path) -> AsyncIterator[Registry]:
    bus = await broker.connect(SERVICES, "registry")
    settings = RegistrySettings(
        output_dir=tmp_path / "out",
        tenants_file=broker.tenants_file,
        ingest_max_request_bytes=8192,
        scan_interval=0.2,
    )
    reg = Registry(bus, settings)
    await reg.start()
    yield reg
    await reg.stop()
    await bus.close()


@pytest.fixture
async def acme(broker: AccountsBroker, registry: Registry) -> AsyncIterator[Bus]:
    bus = await broker.connect("acme")
    yield bus
    await bus.close()


async def eventually(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        await asyncio.sleep(0.05)


async def _submit(acme: Bus, run_id: str, config: dict | None = None) -> object:
    event = RunSubmitted(run_id=run_id, config=config or CONFIG)
    return await acme.publish(sj.runs_subject("submit", "acme"), event, msg_id=f"{run_id}/s")


async def stored(services: Bus, subject: str) -> int:
    info = await services.js.stream_info(sj.RUNS_STREAM, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_bad_writes_are_refused_saying_why_and_nothing_is_stored(
    acme: Bus, registry: Registry
) -> None:
    submits = sj.runs_subject("submit", "acme")
    cases = [
        (submits, b'{"type": "run_submitted", "run_id": 7', "not a valid RunSubmitted"),
        (submits, b"x" * 9000, "ingest_max_request_bytes"),
        (submits, RunSubmitted(run_id="run_a", config={"env": "nope"}), "invalid config"),
        (
            sj.runs_subject("evict", "acme"),
            EvictRequested(run_id="run_none", reason="x"),
            "tenant acme has no run run_none",
        ),
        (
            sj.tenant_rollouts_subject("run_none", "acme"),
            RolloutBatch(run_id="run_none", step=0, policy_version=0, samples=[]),
            "tenant acme has no active run run_none",
        ),
    ]
    for subject, payload, why in cases:
        with pytest.raises(APIError, match=why):
            if isinstance(payload, bytes):
                await acme.js.publish(subject, payload)
            else:
                await acme.publish(subject, payload, attempts=1)
    assert await stored(registry.bus, "plexrl.runs.acme.>") == 0
    info = await registry.bus.js.stream_info(sj.ROLLOUTS_STREAM)
    assert info.state.messages == 0


async def test_a_run_stores_at_most_the_batches_it_can_need_and_deletes_free_its_quota(
    acme: Bus, registry: Registry, tmp_path: Path
) -> None:
    ack = await _submit(acme, "run_a")
    assert not ack.duplicate  # type: ignore[attr-defined]
    await eventually(lambda: registry.records.get("run_a") is not None)
    assert registry.records["run_a"].status == "active"
    again = await _submit(acme, "run_a")  # the same run submitted again: nothing stored
    assert again.duplicate and again.seq == 0  # type: ignore[attr-defined]
    # ckpt.interval 1 + max_async_level 0 + 2: three batches may wait, not a fourth
    subject = sj.tenant_rollouts_subject("run_a", "acme")
    for step in range(3):
        batch = RolloutBatch(run_id="run_a", step=step, policy_version=0, samples=[])
        ack = await acme.publish(subject, batch, msg_id=f"run_a/step_{step}")
        assert ack.stream == sj.ROLLOUTS_STREAM
    stored_batch = await registry.bus.js.get_last_msg(sj.ROLLOUTS_STREAM, subject)
    assert (stored_batch.headers or {})["Nats-Msg-Id"] == "acme/run_a/step_2"
    with pytest.raises(APIError, match="at most 3"):
        batch = RolloutBatch(run_id="run_a", step=3, policy_version=0, samples=[])
        await acme.publish(subject, batch, attempts=1)
    # max_run_dirs = 2: a second run, then a third is refused until one is deleted
    await _submit(acme, "run_b")
    await eventually(lambda: registry.records.get("run_b") is not None)
    with pytest.raises(APIError, match="max_run_dirs = 2"):
        await _submit(acme, "run_c")
    evicts = sj.runs_subject("evict", "acme")
    with pytest.raises(APIError, match="evict it first"):
        await acme.publish(evicts, EvictRequested(run_id="run_b", reason="x", delete=True))
    await acme.publish(evicts, EvictRequested(run_id="run_b", reason="done"))
    await eventually(lambda: registry.records["run_b"].status == "evicted")
    assert (tmp_path / "out" / "run_b").is_dir()
    await acme.publish(evicts, EvictRequested(run_id="run_b", reason="", delete=True))
    await eventually(lambda: registry.records["run_b"].status == "forgotten")
    assert not (tmp_path / "out" / "run_b").exists()
    await _submit(acme, "run_c")
    await eventually(lambda: registry.records.get("run_c") is not None)


async def test_a_burst_of_submits_is_held_to_the_quota_before_any_is_applied(
    acme: Bus, registry: Registry
) -> None:
    # eight submits at once: the registry's consumer applies none of them before the ingest has
    # answered them all, so the ingest must count the ones it stored (max_run_dirs = 2)
    outcomes = await asyncio.gather(
        *(_submit(acme, f"run_burst{k}") for k in range(8)), return_exceptions=True
    )
    refused = [o for o in outcomes if isinstance(o, APIError)]
    assert len(outcomes) - len(refused) == 2, outcomes
    assert all("max_run_dirs = 2" in str(o.description) for o in refused), refused
    await eventually(
        lambda: sum(r.run_id.startswith("run_burst") for r in registry.records.values()) == 2
    )
    await asyncio.sleep(1.0)  # nothing more arrives: the refused ones were never stored
    assert sum(r.run_id.startswith("run_burst") for r in registry.records.values()) == 2


async def test_a_tenant_added_live_gets_its_views_and_one_the_file_drops_is_refused(
    broker: AccountsBroker, registry: Registry, tmp_path: Path
) -> None:
    assert main(["tenants", "add", "newco", "--dir", str(broker.auth)]) == 0
    write_config(broker.auth, broker.server.port, tmp_path / "store")
    broker.server.reload()
    broker.server.reload()
    await eventually(lambda: registry.tenants.knows("newco"), timeout=10)  # the file re-read
    newco = await broker.connect("newco")
    try:
        event = RunSubmitted(run_id="run_n", config=CONFIG)
        await newco.publish(sj.runs_subject("submit", "newco"), event)
        await eventually(lambda: registry.records.get("run_n") is not None)
        names = {i.config.name for i in await newco.js.streams_info()}
        assert names == {sj.RUNS_STREAM, sj.WEIGHTS_STREAM}  # its views, made by the registry
        # dropped from the tenants file (its account still on the server): refused at once
        assert main(["tenants", "remove", "newco", "--dir", str(broker.auth)]) == 0
        await eventually(lambda: not registry.tenants.knows("newco"), timeout=10)
        with pytest.raises(APIError, match="unknown tenant newco"):
            await newco.publish(sj.runs_subject("submit", "newco"), event, attempts=1)
    finally:
        await newco.close()
