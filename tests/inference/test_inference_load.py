"""A replica under load: rollouts first, HTTP sampling in a bounded share and round-robin across
tenants, an overloaded refusal past the bound, and jobs dropped when their deadline passes or
their requester cancels them, freeing their rows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from inference_support import LORA_TARGETS, discover

from schemas import subjects as sj
from schemas.codec import encode
from schemas.events import GenerateCancel, GenerateRequest, GenerateResponse
from services.bus import Bus
from services.inference.admission import HttpBound
from services.inference.jobs import DeadlineExceeded, Job
from services.inference.service import InferenceService
from services.inference.torch_engine import TorchEngine


def _job(name: str, n: int, max_tokens: int, **kw: Any) -> Job:
    fields: dict[str, Any] = {
        "request_id": name,
        "run_id": "run_load",
        "slot": -1,
        "prompts": [[1, 10, 11]],
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_version": 0,
        "seed": 1,
        "ignore_eos": True,
    }
    return Job(**(fields | kw))


async def _engine(tiny_dir: Path, **options: Any) -> TorchEngine:
    engine = TorchEngine(
        tiny_dir, max_runs=2, max_lora_rank=8, target_modules=LORA_TARGETS, **options
    )
    await engine.start()
    return engine


async def test_rollouts_go_first_and_http_sampling_keeps_to_its_share_in_turns(
    tiny_dir: Path,
) -> None:
    engine = await _engine(tiny_dir, max_num_seqs=8, http_share=0.25, batch_window_ms=100)
    try:
        assert engine.continuous is not None and engine.generator is not None
        assert engine.continuous.share.rows == 2
        gen = engine.generator
        most_http_rows = 0
        done: list[str] = []

        async def ask(job: Job) -> None:
            await engine.generate(job)
            done.append(job.request_id)

        # Tenant a's three jobs arrive before tenant b's one, and all of them before the rollout:
        # under first-come-first-served the 14 HTTP sequences would fill the 8 rows first.
        http = [_job(f"a{i}", 4, 20, source="http", tenant="a") for i in range(3)]
        http.append(_job("b0", 2, 20, source="http", tenant="b"))
        tasks = [asyncio.create_task(ask(j)) for j in http]
        tasks.append(asyncio.create_task(ask(_job("rollout", 6, 10))))
        while not all(t.done() for t in tasks):
            rows = [s for s in list(gen.rows) if s is not None]
            most_http_rows = max(
                most_http_rows, sum(s.tag[0].waiting.job.source == "http" for s in rows)
            )
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        assert most_http_rows == 2  # the share, used and never exceeded
        # The rollout, sent last, finished first; tenant b's job came before a's second and third.
        assert done[0] == "rollout"
        assert done.index("b0") < done.index("a1") < done.index("a2")
        assert not gen.active
    finally:
        await engine.close()


async def test_a_job_past_its_deadline_or_cancelled_is_dropped_and_frees_its_rows(
    tiny_dir: Path,
) -> None:
    engine = await _engine(tiny_dir, max_num_seqs=1)
    try:
        assert engine.generator is not None
        gen = engine.generator
        with pytest.raises(DeadlineExceeded):  # already past: dropped while it waits
            await engine.generate(_job("late", 1, 8, deadline=time.time() - 1))
        # 8 sequences one row at a time: thousands of decode steps, stopped mid-way
        with pytest.raises(DeadlineExceeded):
            await engine.generate(_job("slow", 8, 250, deadline=time.time() + 0.3))
        assert not gen.active and engine.continuous is not None and not engine.continuous._partial
        running = asyncio.create_task(engine.generate(_job("gone", 8, 250)))
        while not gen.active:
            await asyncio.sleep(0.001)
        running.cancel()
        while gen.active:
            await asyncio.sleep(0.001)
        result = await engine.generate(_job("next", 1, 4))  # the rows serve the next job
        assert len(result.completions[0][0].token_ids) == 4
        assert running.cancelled()
    finally:
        await engine.close()


@pytest.fixture
async def replica(nats_url: str, tiny_dir: Path, tmp_path: Path) -> AsyncIterator[Any]:
    bus = await Bus.connect(nats_url, "inference")
    engine = TorchEngine(
        tiny_dir, max_runs=2, max_lora_rank=8, target_modules=LORA_TARGETS, max_num_seqs=2
    )
    service = InferenceService(
        bus,
        engine,
        max_runs=2,
        replica_name="replica-load",
        output_dir=tmp_path,
        http_bound=HttpBound(max_requests=2, max_tokens=1 << 20, retry_after_s=3.0),
    )
    await service.start()
    yield service
    await service.stop()
    await bus.close()


def _request(rid: str, **kw: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "request_id": rid,
        "run_id": "run_load_base",
        "prompts": [[1, 10, 11]],
        "n": 2,
        "max_tokens": 40,
        "ignore_eos": True,
        "base_model": True,
        "source": "http",
    }
    return GenerateRequest(**(fields | kw))


async def _ask(bus: Bus, req: GenerateRequest) -> GenerateResponse:
    return await bus.request(sj.GENERATE, req, GenerateResponse, timeout=60)


HELD_TOKENS = 200
"""each held request's length: its 3 prompt tokens plus these must fit the tiny model's 256-token
context, or the replica refuses it as invalid before it is ever held"""


async def test_http_sampling_past_the_bound_is_refused_at_once_and_rollouts_never(
    bus: Bus, uid: str, replica: InferenceService
) -> None:
    # long enough to be running still when the next request comes, however busy the machine
    held = [
        asyncio.create_task(_ask(bus, _request(f"{uid}-{i}", max_tokens=HELD_TOKENS)))
        for i in range(2)
    ]
    while replica.http_bound.requests < 2:
        # one answered before both were held (refused, say) would leave this loop waiting for ever
        early = [task.result() for task in held if task.done()]
        assert not early, early
        await asyncio.sleep(0.005)
    refused = await _ask(bus, _request(f"{uid}-over", max_tokens=1))
    rollout = await _ask(bus, _request(f"{uid}-rollout", source="rollout", max_tokens=1))
    assert (refused.error_code, refused.retry_after_s) == ("overloaded", 3.0)
    assert refused.error is not None and "max_http_requests = 2" in refused.error
    assert rollout.error is None and len(rollout.completions[0][0].token_ids) == 1
    # the two held were running all along, and finish
    for answer in await asyncio.gather(*held):
        assert answer.error is None and len(answer.completions[0][0].token_ids) == HELD_TOKENS
    assert (replica.http_bound.requests, replica.http_bound.tokens) == (0, 0)
    assert replica.held.dropped["overloaded"] == 1


async def test_a_cancelled_or_late_request_is_dropped_and_counted(
    bus: Bus, uid: str, replica: InferenceService
) -> None:
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=0)
    # waiting for a version that is never published: only the cancel ends it
    waiting = asyncio.create_task(
        _ask(bus, _request(f"{uid}-w", run_id=run_id, base_model=False, min_policy_version=5))
    )
    while replica.http_bound.requests < 1:
        await asyncio.sleep(0.005)
    # another tenant's cancel of the same id reaches nothing
    await bus.nc.publish(
        sj.generate_subject("team-x", "cancel"), encode(GenerateCancel(request_id=f"{uid}-w"))
    )
    await bus.nc.flush()
    await asyncio.sleep(0.2)
    assert not waiting.done()
    await bus.nc.publish(sj.CANCEL, encode(GenerateCancel(request_id=f"{uid}-w", reason="left")))
    answer = await waiting
    assert answer.error_code == "cancelled" and answer.completions == []
    late = await _ask(bus, _request(f"{uid}-late", deadline=time.time() - 1))
    assert late.error_code == "deadline_exceeded"
    assert replica.held.dropped == {"cancelled": 1, "deadline": 1}
    assert replica.http_bound.requests == 0
