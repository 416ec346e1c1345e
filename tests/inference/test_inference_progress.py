"""Liveness of requests in flight: a replica holding a request says so on the request's
``progress_subject``, and a requester whose replica dies retries at once (real nats-server,
real replicas, one of them a ``plexrl inference`` process killed with SIGKILL)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from inference_support import discover, lora_spec, random_adapter
from nats.aio.msg import Msg
from nats.js import api

from schemas import subjects as sj
from schemas.codec import DecodeError, decode
from schemas.events import (
    GenerateProgress,
    GenerateRequest,
    GenerateResponse,
    InvalidMessage,
    ServiceError,
)
from services.bus import Bus
from services.inference.requests import REPLICA_HEADER
from services.orchestrator.client import GenerateClient
from services.weights import WeightPublisher

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "schemas" / "examples" / "v1" / "generate_request" / "valid_1.json"


def _request(run_id: str, request_id: str, **kw: Any) -> GenerateRequest:
    fields: dict[str, Any] = {"prompts": [[1, 5, 6]], "max_tokens": 3, "seed": 3}
    return GenerateRequest(request_id=request_id, run_id=run_id, **(fields | kw))


async def _drain(sub: Any, quiet: float = 0.5) -> list[Msg]:
    """Every message ``sub`` receives until ``quiet`` seconds pass without one (at most 200:
    a stream that never ends fails the test's count instead of hanging it)."""
    got: list[Msg] = []
    while len(got) < 200:
        try:
            got.append(await sub.next_msg(timeout=quiet))
        except nats.errors.TimeoutError:
            break
    return got


async def _invalid_reports(bus: Bus) -> list[InvalidMessage]:
    sub = await bus.js.subscribe(
        sj.errors_subject("inference"), ordered_consumer=True, deliver_policy=api.DeliverPolicy.ALL
    )
    try:
        events = [decode(m.data, InvalidMessage | ServiceError) for m in await _drain(sub)]
    finally:
        await sub.unsubscribe()
    return [e for e in events if isinstance(e, InvalidMessage)]


async def _until(check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_a_request_waiting_for_its_version_hears_progress_until_the_reply(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    name = f"beat-{uid}"
    service = await start_replica(name)
    run_id = f"run_p{uid}"
    await discover(bus, run_id, idx=0)
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)

    waiting = _request(
        run_id,
        f"wait-{uid}",
        min_policy_version=1,  # not published yet: the request waits for it
        timeout_s=600.0,
        progress_subject=inbox,
        progress_every_s=0.1,
    )
    asked = asyncio.create_task(bus.request(sj.GENERATE, waiting, GenerateResponse, timeout=600))
    # it hears from the replica at once and again while it waits, before any reply
    msgs = [await sub.next_msg(timeout=60) for _ in range(3)]
    assert not asked.done()
    _, lora = scratch_lora
    adapter = random_adapter(lora, 0, 4, 8.0, seed=7)
    await WeightPublisher(bus, tmp_path).publish(run_id, 0, 1, adapter, lora_spec())
    resp = await asyncio.wait_for(asked, 60)  # bounds a hang only
    assert resp.error is None and resp.policy_version == 1
    # the beats stop with the reply: the drain ends (a beat that went on would fill it)
    msgs += await _drain(sub)
    beats = [decode(m.data, GenerateProgress) for m in msgs]
    assert 3 <= len(beats) < 200
    assert [b.seq for b in beats] == list(range(len(beats)))
    assert {(b.request_id, b.run_id, b.replica) for b in beats} == {
        (waiting.request_id, run_id, name)
    }
    states = [b.state for b in beats]
    assert states[:3] == ["waiting_for_version"] * 3
    assert set(states[3:]) <= {"waiting_for_version", "generating"}
    assert {(m.headers or {}).get(REPLICA_HEADER) for m in msgs} == {name}

    # a request the replica can serve says it is generating, and is answered as ever
    served = _request(run_id, f"serve-{uid}", progress_subject=inbox, progress_every_s=0.1)
    resp = await bus.request(sj.GENERATE, served, GenerateResponse, timeout=20)
    assert resp.error is None and len(resp.completions[0]) == 1 and resp.policy_version == 1
    beats = [decode(m.data, GenerateProgress) for m in await _drain(sub)]
    assert beats and {b.request_id for b in beats} == {served.request_id}
    assert beats[-1].state == "generating"
    assert service.served[run_id] == 2
    await sub.unsubscribe()


async def test_a_progress_subject_outside_the_requesters_inboxes_is_refused(
    bus: Bus, uid: str, start_replica
) -> None:
    service = await start_replica(f"strict-{uid}")
    run_id = f"run_s{uid}"
    await discover(bus, run_id, idx=1)
    targets = {
        sj.GENERATE: [f"victim.{uid}", f"_INBOX_acme.{uid}", "plexrl.inference.generate"],
        sj.generate_subject("acme"): [f"_INBOX.{uid}"],  # acme may name only _INBOX_acme.
    }
    watch = await bus.nc.subscribe(f"victim.{uid}")
    watch_acme = await bus.nc.subscribe(f"_INBOX_acme.{uid}")
    watch_default = await bus.nc.subscribe(f"_INBOX.{uid}")
    for subject, progress_subjects in targets.items():
        for target in progress_subjects:
            req = _request(run_id, f"bad-{uid}", progress_subject=target)
            resp = await bus.request(subject, req, GenerateResponse, timeout=20)
            assert resp.completions == [] and resp.request_id == req.request_id
            assert resp.error is not None
            assert resp.error.startswith(f"invalid GenerateRequest: progress_subject {target!r}")
            assert "a replica publishes progress only to an inbox of the requester" in resp.error
    assert service.served[run_id] == 0
    for sub in (watch, watch_acme, watch_default):
        assert await _drain(sub, quiet=0.3) == []  # nothing was published there
        await sub.unsubscribe()
    reports = [r for r in await _invalid_reports(bus) if f"bad-{uid}".encode() in r.leading_bytes]
    assert len(reports) == 4
    assert all("is refused: a replica publishes progress only to" in r.error for r in reports)
    assert {r.subject for r in reports} == set(targets)


async def test_an_old_request_without_progress_fields_is_served_without_progress(
    bus: Bus, uid: str, start_replica
) -> None:
    name = f"old-{uid}"
    service = await start_replica(name)
    run_id = f"run_o{uid}"
    await discover(bus, run_id, idx=2)
    doc = json.loads(EXAMPLE.read_text())
    del doc["progress_subject"], doc["progress_every_s"]  # what a client sent before them
    doc |= {"request_id": f"old-{uid}", "run_id": run_id, "min_policy_version": 0, "n": 2}
    inboxes = await bus.nc.subscribe("_INBOX.>")  # wherever progress could go
    msg = await bus.nc.request(sj.GENERATE, json.dumps(doc).encode(), timeout=20)
    resp: GenerateResponse = decode(msg.data, GenerateResponse)
    assert resp.error is None and [len(group) for group in resp.completions] == [2]
    assert (msg.headers or {})[REPLICA_HEADER] == name and service.served[run_id] == 1
    progress = []
    for m in await _drain(inboxes, quiet=0.5):
        try:
            progress.append(decode(m.data, GenerateProgress))
        except DecodeError:
            pass  # the reply itself, JetStream deliveries to other inboxes
    assert progress == []
    await inboxes.unsubscribe()


async def test_a_request_held_by_a_killed_replica_is_sent_again_at_once(
    bus: Bus,
    nats_url: str,
    tiny_dir: Path,
    uid: str,
    tmp_path: Path,
    start_replica,
    scratch_lora,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, lora = scratch_lora
    run_id = f"run_k{uid}"
    await discover(bus, run_id, idx=3)
    doomed = f"doomed-{uid}"
    log = (tmp_path / "doomed.log").open("wb")
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "services", "inference", "--model", str(tiny_dir)),
            *("--replica-name", doomed, "--threads", "1", "--output-dir", str(tmp_path)),
        ],
        cwd=REPO,
        env=os.environ | {"PLEXRL_NATS_URL": nats_url},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    caplog.set_level(logging.WARNING, logger="services.orchestrator.client")
    # An attempt may take 600 s: an answer within the minute below proves the early retry.
    client = GenerateClient(
        bus, timeout=600.0, progress_every_s=0.2, initial_backoff=0.05, max_backoff=0.2
    )
    held = _request(run_id, f"held-{uid}", min_policy_version=1, timeout_s=600.0)
    task = asyncio.create_task(client.generate(held))
    try:
        # the replica process starts, takes the request and waits for version 1
        await _until(lambda: client.progress_received >= 1 or task.done(), timeout=120)
        assert not task.done() and proc.poll() is None, (tmp_path / "doomed.log").read_text()
        proc.kill()
        assert await asyncio.to_thread(proc.wait, 30) == -9
        heir = await start_replica(f"heir-{uid}")
        adapter = random_adapter(lora, 0, 4, 8.0, seed=11)
        await WeightPublisher(bus, tmp_path).publish(run_id, 3, 1, adapter, lora_spec())
        resp = await asyncio.wait_for(task, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
        task.cancel()
        log.close()
    assert resp.error is None and resp.policy_version == 1 and len(resp.completions) == 1
    assert heir.served[run_id] == 1
    assert client.silent_replicas == 1 and client.retries >= 1
    warnings = [r.getMessage() for r in caplog.records if "went silent" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"replica {doomed} went silent for ")
    assert warnings[0].endswith(f"while holding request {held.request_id}; retrying")
