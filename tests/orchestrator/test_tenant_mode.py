"""An orchestrator acting for a tenant, on the accounts of ``plexrl nats-config``.

The nats-server below runs the services' account and the accounts of tenants ``acme`` and
``beta``. The registry runs in the services' account (it answers acme's submits and rollouts and
keeps acme's views); the orchestrator connects with acme's seed and ``PLEXRL_TENANT=acme``, so
anything it did outside acme's slice (a KV read, a consumer on a services' stream, a subject of
the default tenant's) would find nothing there at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from accounts_support import AccountsBroker, accounts_broker
from nats.errors import NoRespondersError
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError

from schemas import subjects as sj
from schemas.codec import decode
from schemas.events import (
    GenerateRequest,
    GenerateResponse,
    RolloutBatch,
    RunDiscovered,
    RunEvicted,
)
from schemas.tenant import inbox_prefix
from services.bus import Bus, Follower, MessageMeta, flushed
from services.config.tenants import TenantQuota, TenantsFile
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine
from services.model.lora import DEFAULT_TARGET_MODULES
from services.orchestrator.client import GenerateClient, GenerationError
from services.orchestrator.lifecycle import RunRejected, RunRemoved, RunWatch, admit
from services.orchestrator.run_loop import RunOrchestrator
from services.orchestrator.state import last_published_batch, read_progress
from services.registry.service import Registry
from services.registry.settings import RegistrySettings
from services.tenants.credentials import SERVICES
from services.tenants.views import ensure_views

from .conftest import orch_config
from .replica import ScriptedReplica, fake_weights

RUN = "run_orch"
LORA_TARGETS = list(DEFAULT_TARGET_MODULES)
TENANTS = {"acme": TenantQuota(), "beta": TenantQuota()}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[AccountsBroker]:
    with accounts_broker(tmp_path, TENANTS) as b:
        yield b


@pytest.fixture
async def svc(broker: AccountsBroker) -> AsyncIterator[Bus]:
    """The services' connection; the tenants' views exist (the registry keeps them)."""
    b = await broker.connect(SERVICES)
    for tenant in TENANTS:
        await ensure_views(b.nc, tenant)
    yield b
    await b.close()


@pytest.fixture
async def registry(broker: AccountsBroker, svc: Bus, out: Path) -> AsyncIterator[Registry]:
    rbus = await broker.connect(SERVICES, "registry")
    settings = RegistrySettings(output_dir=out, max_runs=4, scan_interval=3600.0)
    reg = Registry(rbus, settings, tenants=TenantsFile(tenants=TENANTS))
    await reg.start()
    yield reg
    await reg.stop()
    await rbus.close()


class TenantConnection:
    """A tenant's own connection, as its credentials allow: its inbox prefix, its errors kept."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self.bus: Bus | None = None

    async def open(self, broker: AccountsBroker, tenant: str) -> Bus:
        async def on_error(exc: Exception) -> None:
            self.errors.append(exc)

        nc = await nats.connect(
            broker.url,
            nkeys_seed=str(broker.seed(tenant)),
            inbox_prefix=inbox_prefix(tenant),
            error_cb=on_error,
            allow_reconnect=False,
        )
        self.bus = Bus(nc, "orchestrator")
        return self.bus


@pytest.fixture
async def acme(
    broker: AccountsBroker, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[TenantConnection]:
    monkeypatch.setenv("PLEXRL_TENANT", "acme")
    conn = TenantConnection()
    await conn.open(broker, "acme")
    yield conn
    assert conn.bus is not None
    await conn.bus.close()


class TenantReplica(ScriptedReplica):
    """The scripted replica (a services user) serving one tenant's generate subject."""

    def __init__(self, bus: Bus, run_id: str, tenant: str) -> None:
        super().__init__(bus, run_id)
        self.tenant = tenant

    async def start(self) -> TenantReplica:
        self._subs.append(
            await self.bus.nc.subscribe(
                sj.generate_subject(self.tenant),
                queue=sj.INFERENCE_QUEUE_GROUP,
                cb=self._on_request,
            )
        )
        self._subs.append(
            await self.bus.js.subscribe(
                sj.tenant_weights_subject(self.run_id, self.tenant),
                stream=sj.WEIGHTS_STREAM,
                cb=self._on_weights,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.ALL,
            )
        )
        await flushed(self.bus.nc)
        return self


async def stored(bus: Bus, stream: str) -> list[tuple[str, bytes]]:
    """(subject, data) of every message of ``stream``, read with the services' rights."""
    info = await bus.js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(stream, seq)
        out.append((raw.subject or "", raw.data or b""))
    return out


async def trainer_stand_in(svc: Bus, tenant: str, stop: asyncio.Event) -> None:
    """Announce version ``n + 1`` on the tenant's weights subject for each batch ``n``."""
    seen: list[RolloutBatch] = []

    def on_batch(_seq: int, batch: RolloutBatch, _meta: MessageMeta) -> None:
        seen.append(batch)

    follower: Follower[RolloutBatch] = Follower(
        svc,
        sj.ROLLOUTS_STREAM,
        sj.tenant_rollouts_subject(RUN, tenant),
        RolloutBatch,
        on_batch,
    )
    await follower.start()
    try:
        announced = 0
        while not stop.is_set():
            while announced < len(seen):
                step = seen[announced].step + 1
                await svc.publish(
                    sj.tenant_weights_subject(RUN, tenant),
                    fake_weights(RUN, step),
                    msg_id=f"{RUN}/w/{step}",
                )
                announced += 1
            pending = announced
            await follower.wait(lambda: len(seen) > pending, timeout=0.1)  # noqa: B023
    finally:
        await follower.stop()


async def test_a_tenant_orchestrator_runs_on_its_own_subjects(
    broker: AccountsBroker,
    svc: Bus,
    registry: Registry,
    acme: TenantConnection,
    out: Path,
    tokenizer: Any,
) -> None:
    replica = await TenantReplica(svc, RUN, "acme").start()
    stop_trainer = asyncio.Event()
    trainer = asyncio.create_task(trainer_stand_in(svc, "acme", stop_trainer))
    assert acme.bus is not None
    try:
        orch = RunOrchestrator(
            acme.bus,
            RUN,
            orch_config(max_async_level=0),
            output_dir=out,
            tokenizer=tokenizer,
            request_timeout=5.0,
        )
        result = await asyncio.wait_for(orch.run(asyncio.Event()), 60)
    finally:
        stop_trainer.set()
        await trainer
        await replica.stop()
    assert (result.status, result.steps_published, result.policy_version) == ("done", 3, 3)
    assert acme.errors == [], acme.errors

    rollouts = await stored(svc, sj.ROLLOUTS_STREAM)
    assert [s for s, _ in rollouts] == [f"plexrl.rollouts.acme.{RUN}"] * 3
    assert [decode(d, RolloutBatch).step for _, d in rollouts] == [0, 1, 2]
    # stored by the registry under acme's own message ids, prefixed with its tenant
    last = await svc.js.get_last_msg(sj.ROLLOUTS_STREAM, f"plexrl.rollouts.acme.{RUN}")
    assert (last.headers or {})["Nats-Msg-Id"] == f"acme/{RUN}/step_2"
    runs = await stored(svc, sj.RUNS_STREAM)
    assert [s for s, _ in runs] == ["plexrl.runs.acme.submit", "plexrl.runs.acme.discovered"]
    discovered: RunDiscovered = decode(runs[1][1], RunDiscovered)
    assert (discovered.run_id, discovered.tenant) == (RUN, "acme")
    # one request per prompt, two prompts per step (one the replica answered "version not loaded
    # yet", as on a busy machine, comes again with the same id)
    assert len({r.request_id for r in replica.requests}) == 3 * 2
    # max_async_level 0: step n waited for version n, announced on acme's weights subject
    assert sorted({r.min_policy_version for r in replica.requests}) == [0, 1, 2]

    # The resume witnesses a tenant may read: the trainer's progress through the registry's
    # list (none written here); its account holds no rollouts stream, so that witness is absent.
    assert (await last_published_batch(acme.bus, RUN))[0] is None
    assert await read_progress(acme.bus, RUN) is None
    assert acme.errors == [], acme.errors


async def test_another_tenant_can_neither_write_nor_read_acmes_rollouts(
    broker: AccountsBroker, svc: Bus, registry: Registry, acme: TenantConnection
) -> None:
    """beta names acme's rollouts subject (nothing there in beta's account) or acme's run on
    its own subject (the registry refuses it); acme's stored batches stay as they are."""
    batch = RolloutBatch(run_id=RUN, step=4, policy_version=0, samples=[])
    await svc.publish(sj.tenant_rollouts_subject(RUN, "acme"), batch)
    before = await stored(svc, sj.ROLLOUTS_STREAM)
    beta = TenantConnection()
    beta_bus = await beta.open(broker, "beta")
    try:
        with pytest.raises((NoRespondersError, NoStreamResponseError)):
            await beta_bus.js.publish(sj.tenant_rollouts_subject(RUN, "acme"), b"{}")
        with pytest.raises(APIError, match="tenant beta has no active run run_orch"):
            await beta_bus.publish(sj.tenant_rollouts_subject(RUN, "beta"), batch, attempts=1)
        assert (await last_published_batch(beta_bus, RUN, tenant="acme"))[0] is None
    finally:
        await beta_bus.close()
    assert await stored(svc, sj.ROLLOUTS_STREAM) == before
    assert acme.errors == []


async def test_a_lifecycle_event_naming_another_tenant_is_ignored(
    svc: Bus, acme: TenantConnection, caplog: pytest.LogCaptureFixture
) -> None:
    """The subject says acme (the broker vouches for it); a body that says beta is not trusted."""
    forged = RunDiscovered(run_id=RUN, idx=0, config={}, tenant="beta")
    await svc.publish(sj.runs_subject("discovered", "acme"), forged)
    honest = RunEvicted(run_id=RUN, idx=0, reason="quota", tenant="acme")
    await svc.publish(sj.runs_subject("evicted", "acme"), honest)
    # the default tenant's subjects are not acme's to follow
    await svc.publish(sj.EVICTED, RunEvicted(run_id=RUN, idx=0, reason="other tenant"))
    assert acme.bus is not None
    watch = RunWatch(acme.bus, RUN)
    await watch.start()
    try:
        assert watch.tenant == "acme"
        assert [e.event for e in watch.entries] == [honest]
        assert "names tenant 'beta'" in caplog.text
    finally:
        await watch.stop()
    assert acme.errors == []


async def test_without_a_registry_admission_goes_by_the_lifecycle_events(
    svc: Bus, acme: TenantConnection, caplog: pytest.LogCaptureFixture
) -> None:
    """No registry answers the list: an eviction on acme's subjects still ends the run, with
    its reason, and nothing is submitted; the trainer witness is missing, not an error."""
    await svc.publish(
        sj.runs_subject("evicted", "acme"),
        RunEvicted(run_id=RUN, idx=1, reason="diverged", tenant="acme"),
    )
    assert acme.bus is not None
    watch = RunWatch(acme.bus, RUN)
    await watch.start()
    try:
        with pytest.raises(RunRemoved, match="diverged"):
            await admit(acme.bus, watch, orch_config(), submitted_by="t", stop=asyncio.Event())
    finally:
        await watch.stop()
    assert "no registry answers on plexrl.registry.acme.list" in caplog.text
    assert [s for s, _ in await stored(svc, sj.RUNS_STREAM)] == ["plexrl.runs.acme.evicted"]
    assert await read_progress(acme.bus, RUN) is None
    assert "trainer progress unknown" in caplog.text
    assert acme.errors == []


async def test_a_held_run_with_another_config_is_refused_for_a_tenant(
    broker: AccountsBroker, svc: Bus, registry: Registry, acme: TenantConnection
) -> None:
    """The registry's row says active; the RunDiscovered says which config: not this one."""
    assert acme.bus is not None
    first = orch_config()
    watch = RunWatch(acme.bus, RUN)
    await watch.start()
    try:
        admission = await asyncio.wait_for(
            admit(acme.bus, watch, first, submitted_by="t", stop=asyncio.Event()), 30
        )
        assert admission is not None
        with pytest.raises(RunRejected, match="different config"):
            await admit(
                acme.bus, watch, orch_config(seed=8), submitted_by="t", stop=asyncio.Event()
            )
    finally:
        await watch.stop()
    submits = [s for s, _ in await stored(svc, sj.RUNS_STREAM) if s.endswith(".submit")]
    assert submits == ["plexrl.runs.acme.submit"]  # the refused config was never submitted
    assert acme.errors == []


async def test_a_tenant_hears_progress_from_a_real_replica_and_only_in_its_own_inboxes(
    broker: AccountsBroker, svc: Bus, acme: TenantConnection, tiny_dir: Path, out: Path
) -> None:
    """The replica (in the services' account) publishes progress to acme's inbox, under
    ``_INBOX_acme.``, which acme's account imports; a request of acme's that names any other
    progress subject is refused before anything is published."""
    rbus = await broker.connect(SERVICES, "inference")
    engine = TorchEngine(tiny_dir, max_runs=2, max_lora_rank=8, target_modules=LORA_TARGETS)
    service = InferenceService(rbus, engine, max_runs=2, replica_name="svc-replica", output_dir=out)
    await service.start()
    assert acme.bus is not None
    try:
        lora = {"model": {"lora": {"rank": 4, "alpha": 8.0}}}
        discovered = RunDiscovered(run_id=RUN, idx=0, config=lora, tenant="acme")
        await svc.publish(sj.runs_subject("discovered", "acme"), discovered)
        client = GenerateClient(acme.bus, timeout=30.0, progress_every_s=0.1, max_attempts=1)
        waiting = GenerateRequest(
            request_id="acme-wait",
            run_id=RUN,
            prompts=[[1, 5, 6]],
            max_tokens=3,
            min_policy_version=1,  # never published: the replica waits its timeout_s
            timeout_s=1.0,
        )
        with pytest.raises(GenerationError, match="asks for min_policy_version 1"):
            await client.generate(waiting)
        assert client.progress_received >= 4 and client.subject == "plexrl.inference.acme.generate"

        forged = msgspec.structs.replace(
            waiting, request_id="acme-forged", progress_subject="_INBOX.Tq3Xw2cX8mLh0cV5q1Yz7A"
        )
        refused = await acme.bus.request(client.subject, forged, GenerateResponse, timeout=10)
        assert refused.error is not None
        assert "only to an inbox of the requester, a subject under _INBOX_acme." in refused.error
    finally:
        await service.stop()
        await rbus.close()
    assert acme.errors == [], acme.errors
