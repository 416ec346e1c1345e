"""Fair share and quotas as pure functions of the run records (no NATS)."""

from __future__ import annotations

import pytest

from schemas.config import parse_orch_config
from schemas.records import RunRecord, RunStatus
from services.config.tenants import TenantQuota, TenantsFile
from services.registry.fair_share import assign
from services.registry.tenancy import evict_refusal, foreign_owner, quota_refusal

from .helpers import VALID_TOML


def _rec(run_id: str, tenant: str, status: RunStatus, queued_at: int = 0) -> RunRecord:
    return RunRecord(run_id=run_id, tenant=tenant, status=status, queued_at=queued_at)


def _unlimited(tenant: str) -> int | None:
    return None


def test_one_tenant_gets_its_oldest_waiting_runs_first() -> None:
    records = [_rec("run_c", "a", "waiting", 30), _rec("run_b", "a", "waiting", 20)]
    records.append(_rec("run_a", "a", "waiting", 20))  # same time: the run id decides
    assert assign(records, 2, _unlimited) == ["run_a", "run_b"]
    assert assign(records, 5, _unlimited) == ["run_a", "run_b", "run_c"]
    assert assign(records, 0, _unlimited) == []


def test_a_freed_index_goes_to_the_tenant_holding_fewer() -> None:
    # tenant A queued 10 runs and holds 3 of the 4 indices; B queued 1 run, later than all of A's
    records = [_rec(f"run_a{i}", "A", "active", i) for i in range(3)]
    records += [_rec(f"run_a{i}", "A", "waiting", i) for i in range(4, 10)]
    records.append(_rec("run_b0", "B", "waiting", 100))
    assert assign(records, 1, _unlimited) == ["run_b0"]
    # two free indices: B's run first, then A's oldest
    assert assign(records, 2, _unlimited) == ["run_b0", "run_a4"]


def test_round_robin_across_tenants_and_the_oldest_waiter_breaks_ties() -> None:
    records = [_rec(f"run_a{i}", "A", "waiting", 10 + i) for i in range(3)]
    records += [_rec(f"run_b{i}", "B", "waiting", 5 + i) for i in range(3)]
    records += [_rec("run_c0", "C", "waiting", 50)]
    # all hold 0: B's oldest waiter is the oldest; then A and C hold 0 (A waited longer)...
    assert assign(records, 7, _unlimited) == [
        "run_b0",
        "run_a0",
        "run_c0",
        "run_b1",
        "run_a1",
        "run_b2",
        "run_a2",
    ]


def test_a_tenant_at_its_max_runs_waits_even_with_free_indices() -> None:
    records = [_rec("run_a0", "A", "active"), _rec("run_a1", "A", "waiting", 1)]
    records.append(_rec("run_b0", "B", "waiting", 2))
    limits = {"A": 1, "B": None}
    assert assign(records, 3, limits.get) == ["run_b0"]
    assert assign(records, 3, {"A": 2}.get) == ["run_b0", "run_a1"]  # B holds fewer


def test_other_statuses_are_ignored() -> None:
    records = [
        _rec("run_x", "A", "evicted"),
        _rec("run_y", "A", "invalid"),
        _rec("run_z", "A", "forgotten"),
        _rec("run_b", "B", "active"),
        _rec("run_a", "A", "waiting", 9),
        _rec("run_b2", "B", "waiting", 1),
    ]
    assert assign(records, 1, _unlimited) == ["run_a"]


# --- quotas --------------------------------------------------------------------------------------

TENANTS = TenantsFile(
    tenants={
        "team-a": TenantQuota(max_runs=1, max_waiting=1, max_lora_rank=8, max_samples_per_step=16),
        "team-b": TenantQuota(),
    }
)


@pytest.mark.parametrize(
    ("tenant", "toml_rank", "expected"),
    [
        ("stranger", "rank = 8", "unknown tenant stranger: it is not in this registry's"),
        ("team-a", "rank = 16", "tenant team-a quota max_lora_rank = 8: the run asks for rank 16"),
        ("team-b", "rank = 16", None),
        ("default", "rank = 16", None),
    ],
)
def test_quota_refusals_name_the_quota_and_the_numbers(
    tenant: str, toml_rank: str, expected: str | None
) -> None:
    config = parse_orch_config(VALID_TOML.replace("rank = 8", toml_rank))
    refusal = quota_refusal(tenant, config, TENANTS, [], num_free=4)
    if expected is None:
        assert refusal is None
    else:
        assert refusal is not None and refusal.startswith(expected)


def test_samples_per_step_and_waiting_quotas() -> None:
    big = parse_orch_config(VALID_TOML.replace("batch_size = 4", "batch_size = 5"))
    assert quota_refusal("team-a", big, TENANTS, [], 4) == (
        "tenant team-a quota max_samples_per_step = 16: the run asks for 20 (batch_size 5 * "
        "group_size 4)"
    )
    config = parse_orch_config(VALID_TOML)
    active = _rec("run_a0", "team-a", "active")
    waiting = _rec("run_a1", "team-a", "waiting")
    # at max_runs, one waiting already: a second would wait too
    refusal = quota_refusal("team-a", config, TENANTS, [active, waiting], 2)
    assert refusal == (
        "tenant team-a quota max_waiting = 1: 1 of its runs already wait for an index; evict "
        "one or wait until one starts"
    )
    # at max_runs, none waiting: this one may wait
    assert quota_refusal("team-a", config, TENANTS, [active], 2) is None
    # other tenants' waiting runs do not count
    assert quota_refusal("team-a", config, TENANTS, [_rec("run_b", "team-b", "waiting")], 0) is None


def test_only_the_owner_or_the_default_tenant_evicts() -> None:
    rec = _rec("run_a", "team-a", "active")
    assert foreign_owner(rec, "team-a") is None and foreign_owner(rec, "team-b") == "team-a"
    assert foreign_owner(_rec("run_a", "team-a", "forgotten"), "team-b") is None
    assert evict_refusal(rec, "team-a") is None and evict_refusal(rec, "default") is None
    assert evict_refusal(rec, "team-b") == (
        "refused to evict run_a for tenant team-b: the run belongs to tenant team-a, and a tenant "
        "evicts only its own runs"
    )
    assert evict_refusal(None, "team-b") is None  # no such run: the registry says so itself
