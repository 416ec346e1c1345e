"""Tenants against a real nats-server: ownership, quotas, fair share and the run list service."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from schemas import subjects as sj
from schemas.codec import decode
from schemas.config import parse_orch_config
from schemas.events import (
    EvictRequested,
    InvalidMessage,
    RunConfigInvalid,
    RunDiscovered,
    RunList,
    RunListRequest,
    RunSubmitted,
    ServiceError,
)
from schemas.records import Progress
from services.bus import Bus
from services.config.tenants import TenantQuota, TenantsFile, save_tenants
from services.registry.service import Registry
from services.runs.progress import write_progress
from services.runs.table import list_runs

from .conftest import RegistryFactory
from .helpers import VALID_TOML, error_reports, events_on, eventually, table, write_orch

CONFIG = parse_orch_config(VALID_TOML).to_dict()


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.toml"
    save_tenants(
        path,
        TenantsFile(
            tenants={
                "team-a": TenantQuota(max_lora_rank=8, max_samples_per_step=16, max_waiting=1),
                "team-b": TenantQuota(),
                "team-c": TenantQuota(max_runs=1),
            }
        ),
    )
    return path


async def _submit(bus: Bus, tenant: str, run_id: str, config: dict[str, Any] = CONFIG) -> None:
    await bus.publish(sj.runs_subject("submit", tenant), RunSubmitted(run_id=run_id, config=config))


async def _evict(bus: Bus, tenant: str, run_id: str) -> None:
    event = EvictRequested(run_id=run_id, reason="r", requested_by="test")
    await bus.publish(sj.runs_subject("evict", tenant), event)


async def _statuses(bus: Bus, **want: str) -> bool:
    records = await table(bus)
    return all(r in records and records[r].status == s for r, s in want.items())


async def _refusals(bus: Bus, tenant: str, n: int = 1) -> list[RunConfigInvalid]:
    found = await events_on(bus, sj.runs_subject("invalid", tenant), RunConfigInvalid)
    return found if len(found) >= n else []


async def test_a_run_belongs_to_its_submitters_tenant_and_a_scanned_one_to_the_default(
    make_registry: RegistryFactory, rbus: Bus, out: Path, tenants_file: Path
) -> None:
    write_orch(out, "run_scanned")
    registry = await make_registry(tenants_file=tenants_file)
    await _submit(rbus, "team-a", "run_a")
    [event] = await eventually(
        lambda: events_on(rbus, "plexrl.runs.team-a.discovered", RunDiscovered)
    )
    assert (event.run_id, event.idx, event.tenant) == ("run_a", 1, "team-a")
    [scanned] = await events_on(rbus, sj.DISCOVERED, RunDiscovered)
    assert (scanned.run_id, scanned.tenant) == ("run_scanned", "default")
    records = await table(rbus)
    assert (records["run_a"].tenant, records["run_scanned"].tenant) == ("team-a", "default")
    assert registry.records["run_a"].tenant == "team-a"


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            ("rank = 8", "rank = 16"),
            "tenant team-a quota max_lora_rank = 8: the run asks for rank 16",
        ),
        (
            ("batch_size = 4", "batch_size = 5"),
            "tenant team-a quota max_samples_per_step = 16: the run asks for 20 (batch_size 5 * "
            "group_size 4)",
        ),
    ],
    ids=["max_lora_rank", "max_samples_per_step"],
)
async def test_a_submit_over_a_quota_is_refused_and_writes_nothing(
    make_registry: RegistryFactory,
    rbus: Bus,
    out: Path,
    tenants_file: Path,
    change: tuple[str, str],
    expected: str,
) -> None:
    registry = await make_registry(tenants_file=tenants_file, max_lora_rank=64)
    config = parse_orch_config(VALID_TOML.replace(*change)).to_dict()
    await _submit(rbus, "team-a", "run_big", config)
    [refusal] = await eventually(lambda: _refusals(rbus, "team-a"))
    assert (refusal.run_id, refusal.error, refusal.tenant) == ("run_big", expected, "team-a")
    assert "run_big" not in await table(rbus) and not (out / "run_big").exists()
    assert registry.pool.num_free == 4
    # the same config from a tenant without that quota is fine
    await _submit(rbus, "team-b", "run_big", config)
    await eventually(lambda: _statuses(rbus, run_big="active"))


async def test_max_waiting_refuses_a_run_that_would_wait_past_it(
    make_registry: RegistryFactory, rbus: Bus, tenants_file: Path
) -> None:
    await make_registry(tenants_file=tenants_file, max_runs=1)
    for run_id in ("run_1", "run_2"):
        await _submit(rbus, "team-a", run_id)
    await eventually(lambda: _statuses(rbus, run_1="active", run_2="waiting"))
    await _submit(rbus, "team-a", "run_3")
    [refusal] = await eventually(lambda: _refusals(rbus, "team-a"))
    assert refusal.error == (
        "tenant team-a quota max_waiting = 1: 1 of its runs already wait for an index; evict one "
        "or wait until one starts"
    )
    assert "run_3" not in await table(rbus)


async def test_an_unknown_tenant_and_an_unusable_tenant_token_are_refused(
    make_registry: RegistryFactory, rbus: Bus, out: Path, tenants_file: Path
) -> None:
    await make_registry(tenants_file=tenants_file)
    await _submit(rbus, "stranger", "run_s")
    [refusal] = await eventually(lambda: _refusals(rbus, "stranger"))
    assert refusal.error.startswith("unknown tenant stranger: it is not in this registry's")
    # a token no tenant can have (run ids start with run_) is an invalid message
    await rbus.publish("plexrl.runs.run_x.submit", RunSubmitted(run_id="run_t", config=CONFIG))
    [report] = await eventually(lambda: error_reports(rbus))
    assert isinstance(report, InvalidMessage) and report.subject == "plexrl.runs.run_x.submit"
    assert "no usable tenant in subject" in report.error
    assert await table(rbus) == {} and list(out.iterdir()) == []


async def test_a_run_id_of_another_tenant_is_refused_and_the_owner_keeps_it(
    make_registry: RegistryFactory, rbus: Bus, out: Path, tenants_file: Path
) -> None:
    registry = await make_registry(tenants_file=tenants_file)
    await _submit(rbus, "team-a", "run_x")
    await eventually(lambda: _statuses(rbus, run_x="active"))
    before = await table(rbus)
    other = parse_orch_config(VALID_TOML + "\n[optim]\nlr = 0.01\n").to_dict()
    await _submit(rbus, "team-b", "run_x", other)
    await _submit(rbus, "default", "run_x")
    [refusal] = await eventually(lambda: _refusals(rbus, "team-b"))
    # the requester learns that the id is taken, never whose it is
    assert refusal.error == "run id run_x is taken; choose another run id"
    [by_default] = await eventually(lambda: _refusals(rbus, "default"))
    assert by_default.run_id == "run_x" and "is taken" in by_default.error
    reports = await eventually(lambda: _n(error_reports(rbus), 2))
    assert all(isinstance(r, ServiceError) and r.run_id is None for r in reports)
    contexts = [r.context for r in reports if isinstance(r, ServiceError)]
    # the two requests come through two consumers (tenant and default subjects), in any order
    assert sorted((c["tenant"], c["owner"], c["run"]) for c in contexts) == [
        ("default", "team-a", "run_x"),
        ("team-b", "team-a", "run_x"),
    ]
    assert await table(rbus) == before
    assert registry.idx_of("run_x") == 0
    on_disk = parse_orch_config((out / "run_x" / "control" / "orch.toml").read_text())
    assert on_disk.to_dict() == CONFIG


async def test_a_tenant_evicts_only_its_own_runs_the_default_tenant_any(
    make_registry: RegistryFactory, rbus: Bus, out: Path, tenants_file: Path
) -> None:
    registry = await make_registry(tenants_file=tenants_file)
    await _submit(rbus, "team-a", "run_a")
    await _submit(rbus, "team-b", "run_b")
    await eventually(lambda: _statuses(rbus, run_a="active", run_b="active"))
    idx = registry.idx_of("run_a")
    await _evict(rbus, "team-b", "run_a")
    [report] = await eventually(lambda: error_reports(rbus))
    assert isinstance(report, ServiceError) and report.run_id is None
    assert report.error == (
        "refused to evict run_a for tenant team-b: the run belongs to tenant team-a, and a "
        "tenant evicts only its own runs"
    )
    assert (report.context["run"], report.context["tenant"]) == ("run_a", "team-b")
    assert registry.idx_of("run_a") == idx and (await table(rbus))["run_a"].status == "active"
    assert not (out / "run_a" / "control" / "evicted.txt").exists()
    await _evict(rbus, "team-b", "run_b")  # its own
    await _evict(rbus, "default", "run_a")  # services and operators may evict any run
    await eventually(lambda: _statuses(rbus, run_a="evicted", run_b="evicted"))


async def test_fair_share_gives_the_next_freed_index_to_the_tenant_holding_fewer(
    make_registry: RegistryFactory, rbus: Bus, tenants_file: Path
) -> None:
    registry = await make_registry(tenants_file=tenants_file, max_runs=4)
    a_runs = [f"run_a{i}" for i in range(10)]
    for run_id in a_runs:
        await _submit(rbus, "team-b", run_id)  # team-b: no quotas
    await eventually(lambda: _statuses(rbus, **{r: "waiting" for r in a_runs[4:]}))
    await _submit(rbus, "team-c", "run_c0")
    await eventually(lambda: _statuses(rbus, run_c0="waiting"))
    assert [registry.idx_of(r) for r in a_runs[:4]] == [0, 1, 2, 3]
    await _evict(rbus, "default", "run_a2")
    await eventually(lambda: _statuses(rbus, run_a2="evicted", run_c0="active"))
    assert registry.idx_of("run_c0") == 2
    assert registry.idx_of("run_a4") is None
    # team-c holds its max_runs = 1 now: the next freed index goes back to team-b
    await _submit(rbus, "team-c", "run_c1")
    await eventually(lambda: _statuses(rbus, run_c1="waiting"))
    await _evict(rbus, "default", "run_a0")
    await eventually(lambda: _statuses(rbus, run_a4="active"))
    assert registry.idx_of("run_a4") == 0 and registry.idx_of("run_c1") is None


async def test_the_list_service_shows_each_tenant_its_own_runs(
    make_registry: RegistryFactory, rbus: Bus, out: Path, tenants_file: Path
) -> None:
    write_orch(out, "run_d")
    registry = await make_registry(tenants_file=tenants_file)
    await _submit(rbus, "team-a", "run_a")
    await _submit(rbus, "team-b", "run_b")
    await eventually(lambda: _statuses(rbus, run_a="active", run_b="active"))
    await write_progress(rbus, "run_a", Progress(step=3, total_tokens=99, total_samples=12))
    rows = await list_runs(rbus, "team-a")
    assert [(r.run_id, r.tenant, r.status, r.idx, r.step, r.total_samples) for r in rows] == [
        ("run_a", "team-a", "active", 1, 3, 12)
    ]
    assert [r.run_id for r in await list_runs(rbus)] == ["run_d", "run_a", "run_b"]
    assert [r.run_id for r in await list_runs(rbus, "nobody")] == []
    # the tenant named in the body is not trusted: the subject decides
    asked = RunListRequest(tenant="default")
    answer = await rbus.request(sj.registry_list_subject("team-b"), asked, RunList, timeout=5)
    assert (answer.tenant, [r.run_id for r in answer.runs]) == ("team-b", ["run_b"])
    assert registry.idx_of("run_b") == 2
    await _evict(rbus, "default", "run_b")
    await eventually(lambda: _statuses(rbus, run_b="evicted"))
    only = RunListRequest(statuses=["evicted"])
    answer = await rbus.request(sj.REGISTRY_LIST, only, RunList, timeout=5)
    assert [(r.run_id, r.status, r.detail) for r in answer.runs] == [("run_b", "evicted", "r")]
    # an empty body asks with the defaults
    msg = await rbus.nc.request(sj.registry_list_subject("team-a"), b"", timeout=5)
    assert [r.run_id for r in decode(msg.data, RunList).runs] == ["run_a"]


@pytest.mark.parametrize(
    "body",
    [b"[1, 2]", b'{"type": "run_list_request", "statuses": ["running"]}', b"\xff"],
    ids=["array", "status", "bytes"],
)
async def test_a_malformed_list_request_gets_an_error_answer_and_a_report(
    make_registry: RegistryFactory, rbus: Bus, body: bytes
) -> None:
    await make_registry()
    msg = await rbus.nc.request(sj.REGISTRY_LIST, body, timeout=5)
    answer = decode(msg.data, RunList)
    assert answer.runs == [] and (answer.error or "").startswith("not a valid RunListRequest: ")
    [report] = await eventually(lambda: error_reports(rbus))
    assert isinstance(report, InvalidMessage) and report.subject == sj.REGISTRY_LIST
    assert report.error == answer.error and report.leading_bytes == body
    # still serving
    ok = await rbus.request(sj.REGISTRY_LIST, RunListRequest(), RunList, timeout=5)
    assert ok.error is None


async def test_a_restart_keeps_every_runs_tenant(
    make_registry: RegistryFactory, rbus: Bus, tenants_file: Path
) -> None:
    first: Registry = await make_registry(tenants_file=tenants_file, max_runs=1)
    await _submit(rbus, "team-a", "run_a")
    await _submit(rbus, "team-b", "run_b")
    await eventually(lambda: _statuses(rbus, run_a="active", run_b="waiting"))
    await first.stop()
    second = await make_registry(tenants_file=tenants_file, max_runs=1)
    assert {r: second.records[r].tenant for r in ("run_a", "run_b")} == {
        "run_a": "team-a",
        "run_b": "team-b",
    }
    assert second.idx_of("run_a") == 0 and second.pool.waiting == ["run_b"]


async def _n(coro: Any, n: int) -> list[Any]:
    found = await coro
    return found if len(found) >= n else []
