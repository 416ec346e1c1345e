"""What a tenant may do: submit within its quotas, and touch only its own runs.

The quotas come from the tenants file (:mod:`services.config.tenants`). A submit is refused, and
nothing is written, when

- the tenant is not in the tenants file (the default tenant always is);
- the run asks for a LoRA rank above the tenant's ``max_lora_rank``;
- one step of the run (``batch_size * group_size`` samples) is above ``max_samples_per_step``;
- the run would wait for an index while the tenant already has ``max_waiting`` runs waiting;
- the tenant already holds ``max_run_dirs`` run directories (every status but forgotten).

``max_runs`` refuses nothing: a run past it waits, and :mod:`.fair_share` gives it an index once
the tenant holds fewer. Each refusal names the quota and the numbers, so the tenant knows what to
change.

A run id belongs to the tenant whose submit created its record (a forgotten run id is free
again): another tenant can neither submit it nor evict it, except the default tenant (services
and operators), which may evict any run. Every check here is a pure function of the tenants
file, the config and the run records; the service publishes the refusals.
"""

from __future__ import annotations

from collections.abc import Iterable

from schemas.config import OrchConfig
from schemas.records import RunRecord
from schemas.tenant import DEFAULT_TENANT
from services.config.tenants import TenantsFile


def unknown_tenant(tenant: str) -> str:
    return (
        f"unknown tenant {tenant}: it is not in this registry's tenants file; an operator "
        f"adds it with `plexrl tenants add {tenant}`"
    )


def foreign_owner(rec: RunRecord | None, tenant: str) -> str | None:
    """The tenant that owns ``rec``'s run id if it is not ``tenant``, else None."""
    if rec is None or rec.status == "forgotten" or rec.tenant == tenant:
        return None
    return rec.tenant


def evict_refusal(rec: RunRecord | None, tenant: str) -> str | None:
    """Why ``tenant`` may not evict ``rec``'s run, or None if it may."""
    owner = foreign_owner(rec, tenant)
    if tenant == DEFAULT_TENANT or owner is None or rec is None:
        return None
    return (
        f"refused to evict {rec.run_id} for tenant {tenant}: the run belongs to tenant {owner}, "
        "and a tenant evicts only its own runs"
    )


def quota_refusal(
    tenant: str,
    config: OrchConfig,
    tenants: TenantsFile,
    records: Iterable[RunRecord],
    num_free: int,
) -> str | None:
    """Why ``tenant`` may not submit a new run with ``config`` now, or None if it may.

    ``records`` are the registry's run records and ``num_free`` the free indices of the pool.
    """
    if not tenants.knows(tenant):
        return unknown_tenant(tenant)
    quota = tenants.quota(tenant)
    records = list(records)
    if quota.max_run_dirs is not None:
        held = sum(r.tenant == tenant and r.status != "forgotten" for r in records)
        if held >= quota.max_run_dirs:
            return (
                f"tenant {tenant} quota max_run_dirs = {quota.max_run_dirs}: it holds {held} "
                "run directories; delete evicted runs (plexrl evict RUN --delete) to make room"
            )
    rank = config.model.lora.rank
    if quota.max_lora_rank is not None and rank > quota.max_lora_rank:
        return (
            f"tenant {tenant} quota max_lora_rank = {quota.max_lora_rank}: the run asks for rank "
            f"{rank}"
        )
    samples = config.batch_size * config.group_size
    if quota.max_samples_per_step is not None and samples > quota.max_samples_per_step:
        return (
            f"tenant {tenant} quota max_samples_per_step = {quota.max_samples_per_step}: the run "
            f"asks for {samples} (batch_size {config.batch_size} * group_size "
            f"{config.group_size})"
        )
    if quota.max_waiting is not None:
        waiting = sum(r.tenant == tenant and r.status == "waiting" for r in records)
        if not gets_index(tenant, tenants, records, num_free) and waiting >= quota.max_waiting:
            return (
                f"tenant {tenant} quota max_waiting = {quota.max_waiting}: {waiting} of its runs "
                "already wait for an index; evict one or wait until one starts"
            )
    return None


def gets_index(
    tenant: str, tenants: TenantsFile, records: Iterable[RunRecord], num_free: int
) -> bool:
    """Whether a new run of ``tenant`` would take a free index at once: there is one, the
    tenant is under its ``max_runs``, and none of its own older runs waits (they would have it
    already if they could)."""
    quota = tenants.quota(tenant)
    active = waiting = 0
    for rec in records:
        if rec.tenant == tenant:
            active += rec.status == "active"
            waiting += rec.status == "waiting"
    return num_free > 0 and not waiting and (quota.max_runs is None or active < quota.max_runs)
