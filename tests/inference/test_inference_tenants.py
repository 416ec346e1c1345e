"""Tenants at the inference service: who may generate for which run, whose weights load."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import nats.errors
from inference_support import lora_spec, random_adapter
from nats.js import api

from schemas import subjects as sj
from schemas.codec import decode
from schemas.events import (
    GenerateRequest,
    GenerateResponse,
    InvalidMessage,
    RunDiscovered,
    ServiceError,
)
from services.bus import Bus
from services.weights import WeightPublisher
from services.weights.listing import list_keys


def _request(run_id: str, **kw: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "request_id": f"req-{run_id}",
        "run_id": run_id,
        "prompts": [[1, 10, 11]],
        "n": 1,
        "max_tokens": 4,
        "seed": 3,
        "timeout_s": 10.0,
    }
    return GenerateRequest(**(fields | kw))


async def _discover(bus: Bus, run_id: str, idx: int, tenant: str) -> None:
    config = {"model": {"lora": {"rank": 4, "alpha": 8.0}}}
    event = RunDiscovered(run_id=run_id, idx=idx, config=config, tenant=tenant)
    await bus.publish(sj.runs_subject("discovered", tenant), event)


async def _ask(bus: Bus, subject: str, req: GenerateRequest) -> GenerateResponse:
    return await bus.request(subject, req, GenerateResponse, timeout=20.0)


async def _invalid_reports(bus: Bus) -> list[tuple[str, InvalidMessage]]:
    """Every InvalidMessage the inference service reported so far (subject, report)."""
    reports: list[tuple[str, InvalidMessage]] = []
    sub = await bus.js.subscribe(
        sj.errors_subject("inference"), ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except nats.errors.TimeoutError:
                return reports
            event = decode(msg.data, InvalidMessage | ServiceError)
            if isinstance(event, InvalidMessage):
                reports.append((event.subject, event))
    finally:
        await sub.unsubscribe()


async def test_a_tenant_generates_only_for_its_own_runs(bus: Bus, uid: str, start_replica) -> None:
    service = await start_replica()
    run_a, run_b = f"run_a{uid}", f"run_b{uid}"
    await _discover(bus, run_a, 0, "acme")
    await _discover(bus, run_b, 1, "beta")

    ok = await _ask(bus, sj.generate_subject("acme"), _request(run_a))
    assert ok.error is None and len(ok.completions) == 1 and service.served[run_a] == 1

    refused = await _ask(bus, sj.generate_subject("acme"), _request(run_b))
    assert refused.completions == [] and refused.run_id == run_b
    assert refused.error == f"{run_b} does not belong to tenant acme"
    assert service.served[run_b] == 0  # nothing was generated
    reports = [r for s, r in await _invalid_reports(bus) if s == "plexrl.inference.acme.generate"]
    assert any(f"{run_b} does not belong to tenant acme" in r.error for r in reports)

    # the services' own (default) subject may name any tenant's run
    served = await _ask(bus, sj.GENERATE, _request(run_b))
    assert served.error is None and service.served[run_b] == 1


async def test_a_tenant_runs_weights_load_from_its_own_store(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    _, lora = scratch_lora
    await start_replica()
    run_a = f"run_a{uid}"
    await _discover(bus, run_a, 2, "acme")
    publisher = WeightPublisher(bus, tmp_path)
    adapter = random_adapter(lora, 0, 4, 8.0, seed=5)
    event = await publisher.publish(run_a, 2, 1, adapter, lora_spec(), tenant="acme")
    stored = await bus.js.get_last_msg(sj.WEIGHTS_STREAM, f"plexrl.weights.acme.{run_a}")
    assert decode(stored.data or b"", type(event)) == event
    assert event.location in await list_keys(bus, bucket="plexrl-weights-acme")
    assert event.location not in await list_keys(bus)

    resp = await _ask(bus, sj.generate_subject("acme"), _request(run_a, min_policy_version=1))
    assert resp.error is None and resp.policy_version == 1


async def test_weights_announced_by_another_tenant_are_refused(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    _, lora = scratch_lora
    service = await start_replica()
    run_b = f"run_b{uid}"
    await _discover(bus, run_b, 3, "beta")
    assert (await _ask(bus, sj.GENERATE, _request(run_b))).policy_version == 0
    # acme stores an adapter in its own store and announces it for beta's run
    forged = random_adapter(lora, 0, 4, 8.0, seed=6)
    await WeightPublisher(bus, tmp_path).publish(run_b, 3, 1, forged, lora_spec(), tenant="acme")
    for _ in range(250):
        if service.follower.num_wrong_tenant:
            break
        await asyncio.sleep(0.02)
    assert service.follower.num_wrong_tenant == 1
    resp = await _ask(bus, sj.GENERATE, _request(run_b, min_policy_version=1, timeout_s=0.5))
    assert resp.error is not None and "policy version 0" in resp.error
    reports = [r for s, r in await _invalid_reports(bus) if s == f"plexrl.weights.acme.{run_b}"]
    assert any("belongs to tenant 'beta'" in r.error for r in reports)
