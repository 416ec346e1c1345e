"""The inference service on a real nats-server: request/reply, versions, errors, weights."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
from inference_support import discover, evict, lora_spec, random_adapter
from nats.js import api

from schemas.codec import decode, encode
from schemas.events import (
    GenerateRequest,
    GenerateResponse,
    InvalidMessage,
    ServiceError,
)
from schemas.subjects import GENERATE, errors_subject, weights_subject
from services.bus import Bus
from services.inference.requests import REPLICA_HEADER
from services.inference.service import SYNC_INTERVAL
from services.model.sampling import SequenceSpec, generate_batch
from services.weights import WeightPublisher

PROMPTS = [[1, 10, 11, 12], [1, 20]]


def _request(run_id: str, **kw: Any) -> GenerateRequest:
    fields: dict[str, Any] = {
        "request_id": f"req-{run_id}",
        "run_id": run_id,
        "prompts": PROMPTS,
        "n": 2,
        "max_tokens": 8,
        "seed": 11,
        "timeout_s": 10.0,
    }
    return GenerateRequest(**(fields | kw))


async def _ask(bus: Bus, req: GenerateRequest, timeout: float = 20.0) -> GenerateResponse:
    return await bus.request(GENERATE, req, GenerateResponse, timeout=timeout)


class ErrorWatch:
    """Everything published on plexrl.errors.inference from now on."""

    def __init__(self) -> None:
        self.events: list[InvalidMessage | ServiceError] = []
        self.sub: Any = None

    async def start(self, bus: Bus) -> ErrorWatch:
        async def on_msg(msg: Any) -> None:
            self.events.append(decode(msg.data, InvalidMessage | ServiceError))

        self.sub = await bus.js.subscribe(
            errors_subject("inference"),
            cb=on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.NEW,
        )
        return self

    async def wait_for(self, predicate: Any, timeout: float = 10.0) -> list[Any]:
        for _ in range(int(timeout / 0.02)):
            found = [e for e in self.events if predicate(e)]
            if found:
                return found
            await asyncio.sleep(0.02)
        raise AssertionError(f"no matching error report among {self.events}")


async def test_request_reply_at_version_zero(bus: Bus, uid: str, start_replica) -> None:
    service = await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=0)
    msg = await bus.nc.request(GENERATE, encode(_request(run_id)), timeout=20)
    assert (msg.headers or {})[REPLICA_HEADER] == "replica-a"
    resp: GenerateResponse = decode(msg.data, GenerateResponse)
    assert resp.error is None
    assert (resp.request_id, resp.run_id, resp.policy_version) == (f"req-{run_id}", run_id, 0)
    assert [len(group) for group in resp.completions] == [2, 2]
    for completion in (c for group in resp.completions for c in group):
        assert 1 <= len(completion.token_ids) <= 8
        assert len(completion.logprobs) == len(completion.token_ids)
        assert all(lp <= 0 for lp in completion.logprobs)
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == 8
        else:
            assert completion.token_ids[-1] == 2  # <eos>, included
    again = await _ask(bus, _request(run_id, request_id=f"again-{run_id}"))
    assert again.completions == resp.completions  # same seed, same completions
    assert service.served[run_id] == 2


async def test_a_request_sent_again_is_generated_once(bus: Bus, uid: str, start_replica) -> None:
    """A requester sends a request again when it may have been lost (a reconnect, a silent
    replica): copies of it, concurrent or later, get the one generation's answer; a request
    that failed is generated anew, and the same request id asking for something else is
    another request."""
    service = await start_replica()
    run_id = f"run_{uid}"
    early = await _ask(bus, _request(run_id, request_id="copied"))
    assert early.error is not None and "unknown run" in early.error  # not stored
    await discover(bus, run_id, idx=0)
    first, second = await asyncio.gather(
        _ask(bus, _request(run_id, request_id="copied")),
        _ask(bus, _request(run_id, request_id="copied", timeout_s=60.0)),
    )
    later = await _ask(bus, _request(run_id, request_id="copied"))
    assert first.error is None and first.completions
    assert second == first and later == first
    assert (service.served[run_id], service.answers.copies) == (1, 2)
    other = await _ask(bus, _request(run_id, request_id="copied", seed=99))
    assert other.error is None and service.served[run_id] == 2


async def test_unknown_run_gets_an_error_naming_it(bus: Bus, uid: str, start_replica) -> None:
    await start_replica()
    resp = await _ask(bus, _request(f"run_nobody_{uid}"))
    assert resp.completions == []
    assert resp.error is not None and f"unknown run run_nobody_{uid}" in resp.error


async def test_waits_for_min_policy_version_then_serves_it(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    model, lora = scratch_lora
    await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=1)
    req = _request(run_id, min_policy_version=1, temperature=0.0, n=1)
    waiting = asyncio.create_task(_ask(bus, req))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    adapter = random_adapter(lora, 1, 4, 8.0, seed=21)
    await WeightPublisher(bus, tmp_path).publish(run_id, 1, 1, adapter, lora_spec())
    resp = await waiting
    assert resp.error is None and resp.policy_version == 1
    # The served adapter is the published one: greedy decoding on the scratch model holding it.
    eos = [2]
    for prompt, group in zip(PROMPTS, resp.completions, strict=True):
        spec = SequenceSpec(prompt, slot=1, max_tokens=8, temperature=0.0)
        (ref,) = generate_batch(model, lora, [spec], eos_ids=eos, pad_id=0)
        assert group[0].token_ids == ref.token_ids


async def test_timeout_names_the_version_held_and_the_one_asked(
    bus: Bus, uid: str, start_replica
) -> None:
    await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=2)
    resp = await _ask(bus, _request(run_id, min_policy_version=5, timeout_s=0.4))
    assert resp.completions == [] and resp.error is not None
    assert "policy version 0" in resp.error and "min_policy_version 5" in resp.error


async def test_malformed_requests_get_error_replies_and_reports(
    bus: Bus, uid: str, start_replica
) -> None:
    service = await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=0)
    watch = await ErrorWatch().start(bus)
    good = msgspec.to_builtins(_request(run_id, request_id=f"ok-{uid}"))
    bad_payloads = {
        "bad json": b"{not json " + uid.encode(),
        "wrong type": encode(
            GenerateResponse(
                request_id=f"wt-{uid}", run_id=run_id, policy_version=0, completions=[]
            )
        ),
        "illegal run id": msgspec.json.encode(good | {"request_id": f"id-{uid}", "run_id": "../x"}),
        "out of vocabulary": msgspec.json.encode(
            good | {"request_id": f"oov-{uid}", "prompts": [[1, 5000]]}
        ),
    }
    replies: dict[str, GenerateResponse] = {}
    for name, payload in bad_payloads.items():
        reply = await bus.nc.request(GENERATE, payload, timeout=10)
        resp: GenerateResponse = decode(reply.data, GenerateResponse)
        replies[name] = resp
        assert resp.completions == [] and resp.error, name
        assert resp.error.startswith("invalid GenerateRequest"), name
    assert replies["bad json"].request_id == ""
    assert replies["wrong type"].request_id == f"wt-{uid}"  # salvaged for the requester
    assert "run_id" in (replies["illegal run id"].error or "")
    assert "outside the model's vocabulary" in (replies["out of vocabulary"].error or "")
    for _ in range(250):
        reports = [
            e for e in watch.events if isinstance(e, InvalidMessage) and e.subject == GENERATE
        ]
        if len(reports) >= 4:
            break
        await asyncio.sleep(0.02)
    assert len(reports) == 4
    assert reports[0].leading_bytes.startswith(b"{not json")
    # ... and it keeps serving.
    assert (await _ask(bus, _request(run_id))).error is None
    assert service.errors == 4


async def test_corrupted_blob_keeps_the_previous_version_and_is_not_retried_forever(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    _, lora = scratch_lora
    service = await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=3)
    watch = await ErrorWatch().start(bus)
    good = await WeightPublisher(bus, tmp_path).publish(
        run_id, 3, 1, random_adapter(lora, 0, 4, 8.0, seed=31), lora_spec()
    )
    assert (await _ask(bus, _request(run_id, min_policy_version=1))).policy_version == 1
    corrupt = msgspec.structs.replace(good, step=2, digest="sha256:" + "ab" * 32)
    await bus.publish(weights_subject(run_id), corrupt)
    (report,) = await watch.wait_for(lambda e: isinstance(e, ServiceError) and e.run_id == run_id)
    assert "digest mismatch" in report.error and report.context["step"] == "2"
    # Given up: nothing of the run waits or loads any more. A replica that went on retrying
    # would never be idle; the limit only bounds that hang.
    await asyncio.wait_for(service.follower.idle(), 60.0)
    assert service.follower.tries[(run_id, 2)] == 2
    resp = await _ask(bus, _request(run_id))
    assert resp.error is None and resp.policy_version == 1
    # The run's next announcement starts afresh and loads at its first try; by then step 2 has
    # still had its two tries and one report.
    await WeightPublisher(bus, tmp_path).publish(
        run_id, 3, 3, random_adapter(lora, 0, 4, 8.0, seed=32), lora_spec()
    )
    assert (await _ask(bus, _request(run_id, min_policy_version=3))).policy_version == 3
    await asyncio.wait_for(service.follower.idle(), 60.0)
    assert (service.follower.tries[(run_id, 2)], service.follower.tries[(run_id, 3)]) == (2, 1)
    assert len([e for e in watch.events if getattr(e, "run_id", None) == run_id]) == 1


async def test_a_late_older_version_is_ignored(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    _, lora = scratch_lora
    service = await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=1)
    publisher = WeightPublisher(bus, tmp_path)
    await publisher.publish(run_id, 1, 2, random_adapter(lora, 0, 4, 8.0, seed=41), lora_spec())
    assert (await _ask(bus, _request(run_id, min_policy_version=2))).policy_version == 2
    await publisher.publish(run_id, 1, 1, random_adapter(lora, 0, 4, 8.0, seed=42), lora_spec())
    for _ in range(200):
        if service.ignored_versions:
            break
        await asyncio.sleep(0.02)
    assert service.ignored_versions == 1
    assert (await _ask(bus, _request(run_id))).policy_version == 2


async def test_weights_for_a_run_not_yet_known_apply_when_it_appears(
    bus: Bus, uid: str, start_replica, scratch_lora, tmp_path: Path
) -> None:
    _, lora = scratch_lora
    await start_replica()
    run_id = f"run_{uid}"
    adapter = random_adapter(lora, 0, 4, 8.0, seed=51)
    await WeightPublisher(bus, tmp_path).publish(run_id, 2, 3, adapter, lora_spec())
    await asyncio.sleep(0.3)
    await discover(bus, run_id, idx=2)
    resp = await _ask(bus, _request(run_id, min_policy_version=3))
    assert resp.error is None and resp.policy_version == 3


async def test_an_evicted_run_is_no_longer_served(bus: Bus, uid: str, start_replica) -> None:
    await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=0)
    assert (await _ask(bus, _request(run_id))).error is None
    await evict(bus, run_id, idx=0)
    # The mirror applies lifecycle events every SYNC_INTERVAL; requests in between still see it.
    await asyncio.sleep(3 * SYNC_INTERVAL)
    resp = await _ask(bus, _request(run_id))
    assert resp.error is not None and f"unknown run {run_id}" in resp.error


async def test_two_replicas_share_the_load_and_answer_each_request_once(
    bus: Bus, uid: str, start_replica
) -> None:
    first = await start_replica("replica-a")
    second = await start_replica("replica-b")
    runs = [f"run_{uid}_{i}" for i in range(4)]
    for idx, run_id in enumerate(runs):
        await discover(bus, run_id, idx=idx)
    # Each replica first replays the session's streams (every earlier test's runs and adapters),
    # which on a loaded machine can take longer than a request's own wait: this test is about
    # sharing the load, so it starts once both replicas serve all four runs.
    for _ in range(3000):
        if all(
            r.engine.available_version(idx, run_id) is not None
            for r in (first, second)
            for idx, run_id in enumerate(runs)
        ):
            break
        await asyncio.sleep(0.05)
    inbox = f"_INBOX.{uid}"
    replies: list[tuple[str, GenerateResponse]] = []

    async def on_reply(msg: Any) -> None:
        replies.append(((msg.headers or {})[REPLICA_HEADER], decode(msg.data, GenerateResponse)))

    sub = await bus.nc.subscribe(inbox + ".*", cb=on_reply)
    for i in range(40):
        req = _request(runs[i % 4], request_id=f"r{i}", n=1, max_tokens=4, seed=i % 8)
        await bus.nc.publish(GENERATE, encode(req), reply=f"{inbox}.{i}")
    for _ in range(1500):
        if len(replies) >= 40:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # a duplicate answer would arrive by now
    await sub.unsubscribe()
    assert sorted(r.request_id for _, r in replies) == sorted(f"r{i}" for i in range(40))
    assert all(r.error is None for _, r in replies), [r.error for _, r in replies if r.error]
    by_replica = {
        name: sum(1 for n, _ in replies if n == name) for name in ("replica-a", "replica-b")
    }
    assert by_replica["replica-a"] > 0 and by_replica["replica-b"] > 0, by_replica
    assert sum(first.served.values()) == by_replica["replica-a"]
    assert sum(second.served.values()) == by_replica["replica-b"]
    # Requests i and i + 8 ask for the same run and seed: the same completions, whichever
    # replica and batch served each.
    tokens = {r.request_id: r.completions[0][0].token_ids for _, r in replies}
    assert all(tokens[f"r{i}"] == tokens[f"r{i + 8}"] for i in range(32))


async def test_msgpack_requests_get_msgpack_replies(bus: Bus, uid: str, start_replica) -> None:
    await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=1)
    payload = encode(_request(run_id, n=1), "msgpack")
    msg = await bus.nc.request(
        GENERATE, payload, timeout=20, headers={"Content-Type": "application/msgpack"}
    )
    assert (msg.headers or {})["Content-Type"] == "application/msgpack"
    resp: GenerateResponse = decode(msg.data, GenerateResponse, "application/msgpack")
    assert resp.error is None and len(resp.completions) == len(PROMPTS)


async def test_stopping_answers_waiting_requests_at_once(bus: Bus, uid: str, start_replica) -> None:
    service = await start_replica()
    run_id = f"run_{uid}"
    await discover(bus, run_id, idx=2)
    waiting = asyncio.create_task(_ask(bus, _request(run_id, min_policy_version=9, timeout_s=60)))
    await asyncio.sleep(0.3)
    await asyncio.wait_for(service.stop(), timeout=10)
    resp = await asyncio.wait_for(waiting, timeout=5)
    assert resp.error is not None and "shutting down" in resp.error
