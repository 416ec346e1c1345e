"""Tenant isolation tried as an attacker works: globex, with its own valid seed and API key,
against acme on one deployment made as the README says (conftest.py).

Each test takes every way in globex is allowed (its account's JetStream API, headers, reply
subjects, consumer configs, its storage, the gateway's routes), or none at all, and then checks
acme, not only the error globex got: acme's runs and their steps, the loss of acme's trained run
on a fixed datum (any change to its adapter moves it), the events in acme's own view and the
services' stored events about acme are exactly what they were, and acme can still submit, train
and evict.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator

import httpx
import nats
import pytest
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, NotFoundError
from victim_support import (
    ACME,
    AcmeState,
    acme_state,
    eventually,
    evict,
    rows,
    status_of,
    submit,
    train_step,
)

from schemas import subjects as sj
from schemas.codec import decode, encode
from schemas.events import (
    GenerateCancel,
    GenerateRequest,
    GenerateResponse,
    RolloutBatch,
    Sample,
)
from services.bus import Bus, flushed
from services.tenants.accounts import SERVICES_JS_PREFIX, object_store_stream
from services.tenants.credentials import SERVICES

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GLOBEX = "globex"
VICTIM_RUN = "run_victim"


@pytest.fixture(scope="module")
async def services(deployment) -> AsyncIterator[Bus]:
    bus = await deployment.broker.connect(SERVICES)
    yield bus
    await bus.close()


@pytest.fixture(scope="module")
async def acme(deployment) -> AsyncIterator[Bus]:
    bus = await deployment.broker.connect(ACME)
    await submit(bus, ACME, VICTIM_RUN)
    await eventually(lambda: _is(bus, VICTIM_RUN, "active"))
    for _ in range(2):
        await train_step(bus, VICTIM_RUN)
    yield bus
    await bus.close()


@pytest.fixture
async def globex(deployment) -> AsyncIterator[Bus]:
    bus = await deployment.broker.connect(GLOBEX)
    yield bus
    await bus.close()


@pytest.fixture
async def before(acme: Bus, services: Bus) -> AcmeState:
    return await acme_state(acme, services, VICTIM_RUN)


async def _is(bus: Bus, run_id: str, status: str) -> bool:
    return await status_of(bus, ACME, run_id) == status


async def assert_unchanged(before: AcmeState, acme: Bus, services: Bus) -> None:
    after = await acme_state(acme, services, VICTIM_RUN)
    assert after == before
    assert after.runs[VICTIM_RUN][0] == "active"


async def acme_still_works(acme: Bus) -> None:
    """acme submits, sees, trains and evicts a fresh run."""
    run_id = f"run_acme_{uuid.uuid4().hex[:8]}"
    ack = await submit(acme, ACME, run_id)
    assert not ack.duplicate
    await eventually(lambda: _is(acme, run_id, "active"))
    seen = await acme.js.get_last_msg(sj.RUNS_STREAM, sj.runs_subject("discovered", ACME))
    assert run_id.encode() in (seen.data or b"")
    assert await train_step(acme, run_id) == 1
    await evict(acme, ACME, run_id)
    await eventually(lambda: _is(acme, run_id, "evicted"))


# --- 1. the gateway -----------------------------------------------------------------------------

ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": VICTIM_RUN, "prompt": "ab", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": VICTIM_RUN, "messages": [{"role": "user"}]}),
    ("GET", "/api/v1/get_server_capabilities", None),
    ("POST", "/api/v1/create_model", {"session_id": "s", "model_seq_id": 0}),
    ("POST", "/api/v1/get_info", {"model_id": VICTIM_RUN}),
    ("POST", "/api/v1/optim_step", {"model_id": VICTIM_RUN, "adam_params": {}}),
    ("POST", "/api/v1/retrieve_future", {"request_id": "optim_step-x"}),
]


@pytest.mark.parametrize("key", [None, "tml-plexrl-not-a-key"], ids=["no key", "wrong key"])
async def test_the_gateway_refuses_every_route_without_a_valid_key(
    deployment, acme: Bus, services: Bus, before: AcmeState, key: str | None
) -> None:
    headers = {"X-API-Key": key} if key else {}
    async with httpx.AsyncClient(base_url=deployment.gateway, headers=headers) as http:
        for method, path, body in ROUTES:
            answer = await http.request(method, path, json=body)
            assert answer.status_code == 401, (path, answer.text)
            shape = answer.json()
            if path.startswith("/api/"):
                assert "API key" in shape["detail"]
            else:
                assert shape["error"]["code"] == "invalid_api_key"
        assert (await http.get("/healthz")).status_code == 200
    await assert_unchanged(before, acme, services)


def _forward_backward_proto(run_id: str) -> bytes:
    """A cross-entropy ``forward_backward`` of one datum on ``run_id``, encoded by the SDK."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 5, 6]),
        loss_fn_inputs={"target_tokens": [5, 6, 2]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=run_id,
        seq_id=7,
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


async def test_another_tenants_key_reaches_none_of_acmes_runs(
    deployment, acme: Bus, services: Bus
) -> None:
    acme_key = {"X-API-Key": deployment.key(ACME)}
    async with httpx.AsyncClient(base_url=deployment.gateway, timeout=60) as http:
        started = await http.post(
            "/api/v1/get_info", json={"model_id": VICTIM_RUN}, headers=acme_key
        )
        assert started.status_code == 200, started.text
        # a future of acme's, to be guessed or stolen: acme's own step of its run
        made = await http.post(
            "/api/v1/optim_step",
            json={"model_id": VICTIM_RUN, "seq_id": 1, "adam_params": {"learning_rate": 0.0}},
            headers=acme_key,
        )
        acme_future = made.json()["request_id"]
        assert len(acme_future) > 30 and ":" not in acme_future  # random, not kind:model:seq
        await http.post(
            "/api/v1/retrieve_future", json={"request_id": acme_future}, headers=acme_key
        )
        before = await acme_state(acme, services, VICTIM_RUN)
        mine = {"Authorization": f"Bearer {deployment.key(GLOBEX)}"}
        models = (await http.get("/v1/models", headers=mine)).json()["data"]
        assert VICTIM_RUN not in [m["id"] for m in models]
        done = await http.post(
            "/v1/completions",
            json={"model": VICTIM_RUN, "prompt": "ab", "max_tokens": 2},
            headers=mine,
        )
        assert done.status_code == 404 and "acme" not in done.text, done.text
        for path, body in (
            ("/api/v1/get_info", {"model_id": VICTIM_RUN}),
            ("/api/v1/optim_step", {"model_id": VICTIM_RUN, "adam_params": {"learning_rate": 10}}),
            ("/api/v1/save_weights", {"model_id": VICTIM_RUN, "path": "stolen"}),
            (
                "/api/v1/load_weights",
                {"model_id": VICTIM_RUN, "path": f"tinker://{VICTIM_RUN}/weights/x"},
            ),
            ("/api/v1/retrieve_future", {"request_id": acme_future}),
        ):
            answer = await http.post(path, json=body, headers=mine)
            outcome = answer.json()
            if answer.status_code == 200 and "request_id" in outcome:  # a future: its outcome
                polled = await http.post(
                    "/api/v1/retrieve_future",
                    json={"request_id": outcome["request_id"]},
                    headers=mine,
                )
                outcome = polled.json()
                assert "error" in outcome, (path, outcome)
            else:
                assert answer.status_code in (400, 404), (path, answer.text)
        # forward_backward as the SDK sends it (protobuf, so a 400 would be a decoding error and
        # prove nothing): refused as another tenant's run, now or as its future's outcome
        sent = await http.post(
            "/api/v1/forward_backward",
            content=_forward_backward_proto(VICTIM_RUN),
            headers={**mine, "content-type": "application/x-protobuf"},
        )
        assert sent.status_code in (200, 404), sent.text
        if sent.status_code == 200:
            polled = await http.post(
                "/api/v1/retrieve_future",
                json={"request_id": sent.json()["request_id"]},
                headers=mine,
            )
            assert "error" in polled.json(), polled.text
        # acme still gets its own future
        assert (
            await http.post(
                "/api/v1/retrieve_future", json={"request_id": acme_future}, headers=acme_key
            )
        ).status_code == 200
    assert await acme_state(acme, services, VICTIM_RUN) == before


async def test_deep_or_huge_requests_are_refused_at_the_gateway(deployment) -> None:
    mine = {"X-API-Key": deployment.key(GLOBEX)}
    deep = '{"model": "tiny-base", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    async with httpx.AsyncClient(base_url=deployment.gateway, headers=mine, timeout=60) as http:
        answer = await http.post("/v1/completions", content=deep.encode())
        assert answer.status_code == 400 and "nests deeper" in answer.json()["error"]["message"]
        many = {"model": "tiny-base", "prompt": ["ab"] * 3000, "max_tokens": 1}
        answer = await http.post("/v1/completions", json=many)
        assert answer.status_code == 400 and "max_prompts" in answer.json()["error"]["message"]
        big = {"model": "tiny-base", "prompt": ["ab"] * 8, "n": 32, "max_tokens": 32}
        answer = await http.post("/v1/completions", json=big)
        assert answer.status_code == 400
        assert "max_request_tokens" in answer.json()["error"]["message"]


# --- 2. the services' consumers -----------------------------------------------------------------


async def test_consumer_creates_and_updates_by_any_name_reach_only_globexs_account(
    globex: Bus, acme: Bus, services: Bus, before: AcmeState
) -> None:
    consumers = {
        s: {c.name: c.config for c in await services.js.consumers_info(s)}
        for s in (sj.RUNS_STREAM, sj.ROLLOUTS_STREAM)
    }
    assert {"registry-submit-tenants", "registry-evict-tenants"} <= set(consumers[sj.RUNS_STREAM])
    for stream, names in consumers.items():
        for name in names:
            for filter_subject in ("plexrl.runs.globex.>", "plexrl.runs.acme.>", ">"):
                config = api.ConsumerConfig(
                    durable_name=name, filter_subject=filter_subject, deliver_subject="x.y"
                )
                try:
                    await globex.js.add_consumer(stream, config)
                except APIError:
                    pass  # the stream is not in globex's account, or its filter is not there
    after = {
        s: {c.name: c.config for c in await services.js.consumers_info(s)}
        for s in (sj.RUNS_STREAM, sj.ROLLOUTS_STREAM)
    }
    assert after == consumers
    await assert_unchanged(before, acme, services)
    await acme_still_works(acme)


# --- 3. duplicate detection ----------------------------------------------------------------------


async def test_message_ids_of_acme_published_first_by_globex_drop_nothing_of_acme(
    globex: Bus, acme: Bus, services: Bus
) -> None:
    run_id = f"run_dup_{uuid.uuid4().hex[:8]}"
    # every id acme's submit, its rollouts and the registry's events of the run will carry
    ids = [f"{run_id}/submit/1", f"{run_id}/step_0", f"{run_id}/evicted/1"]
    ids += [f"{run_id}/discovered/{k}" for k in range(4)]
    for msg_id in ids:
        for subject in (sj.runs_subject("submit", GLOBEX), sj.runs_subject("evict", GLOBEX)):
            with pytest.raises(APIError):  # refused: no such runs of globex's, nothing stored
                await globex.js.publish(subject, b"{}", headers={"Nats-Msg-Id": msg_id})
    ack = await acme.js.publish(
        sj.runs_subject("submit", ACME),
        json.dumps(
            {"type": "run_submitted", "run_id": run_id, "config": _rollouts_config()}
        ).encode(),
        headers={"Nats-Msg-Id": ids[0]},
    )
    assert not ack.duplicate and ack.stream == sj.RUNS_STREAM
    await eventually(lambda: _is(acme, run_id, "active"))  # its RunDiscovered was stored
    stored = await services.js.get_last_msg(sj.RUNS_STREAM, sj.runs_subject("submit", ACME))
    assert (stored.headers or {})["Nats-Msg-Id"] == f"acme/{ids[0]}"  # prefixed by the tenant
    batch = RolloutBatch(
        run_id=run_id,
        step=0,
        policy_version=0,
        samples=[
            Sample(
                prompt_ids=[1, 5],
                completion_ids=[6, 2],
                completion_logprobs=[-1.0, -1.0],
                reward=1.0,
                advantage=0.5,
            )
        ],
    )
    ack = await acme.publish(sj.tenant_rollouts_subject(run_id, ACME), batch, msg_id=ids[1])
    assert not ack.duplicate
    # trained (so nothing of this run changes after the test: the next test's "before")
    await eventually(lambda: _trained(acme, run_id))
    await evict(acme, ACME, run_id)
    await eventually(lambda: _is(acme, run_id, "evicted"))
    # its RunEvicted was stored: acme's view stores the event as it arrives from the services'
    # account, a moment after the run list says evicted (until then its last is an earlier run's)
    await eventually(lambda: _last_evicted_is(acme, run_id))


async def _last_evicted_is(acme: Bus, run_id: str) -> bool:
    evicted = await acme.js.get_last_msg(sj.RUNS_STREAM, sj.runs_subject("evicted", ACME))
    return run_id.encode() in (evicted.data or b"")


async def _trained(acme: Bus, run_id: str) -> bool:
    return (await rows(acme, ACME)).get(run_id, (None, 0))[1] == 1


def _rollouts_config() -> dict:
    return {
        "env": "reverse",
        "max_steps": 5,
        "batch_size": 1,
        "group_size": 1,
        "model": {"lora": {"rank": 4, "alpha": 8}},
    }


# --- 4. storage ---------------------------------------------------------------------------------


async def test_a_tenant_that_fills_its_storage_stops_only_itself(
    globex: Bus, acme: Bus, services: Bus, before: AcmeState
) -> None:
    # its own JetStream: a stream past its quota is refused, and filling one stops at the quota
    with pytest.raises(APIError, match=r"insufficient storage|resource limits"):
        await globex.js.add_stream(name="HOARD_BIG", subjects=["hoard.big"], max_bytes=1 << 30)
    await globex.js.add_stream(name="HOARD", subjects=["hoard.>"])
    chunk = b"x" * (512 * 1024)
    with pytest.raises(APIError, match="resource limits exceeded") as full:
        for _ in range(200):
            await globex.js.publish("hoard.x", chunk, timeout=10)
    assert full.value.code == 400
    # the shared streams: a huge submit, and more runs than its quotas, are refused and stored
    # nowhere; what is refused says why
    with pytest.raises(APIError, match="ingest_max_request_bytes"):
        await globex.js.publish(
            sj.runs_subject("submit", GLOBEX), b'{"type":"run_submitted",' + b" " * (900 << 10)
        )
    refusals = []
    for k in range(6):
        try:
            await submit(globex, GLOBEX, f"run_g_{uuid.uuid4().hex[:6]}_{k}")
        except APIError as exc:
            refusals.append(exc.description)
    assert refusals and all("quota" in r for r in refusals), refusals
    runs = await services.js.stream_info(sj.RUNS_STREAM, subjects_filter="plexrl.runs.globex.>")
    assert sum((runs.state.subjects or {}).values()) <= 6  # what its quotas let through
    # in the same test, acme's submit and evict succeed, and its runs are as they were
    await assert_unchanged(before, acme, services)
    await acme_still_works(acme)
    await globex.js.delete_stream("HOARD")


# --- 5. push consumers and reply subjects --------------------------------------------------------


async def test_globexs_push_consumers_and_replies_deliver_nothing_to_acme(
    globex: Bus, acme: Bus, services: Bus, before: AcmeState
) -> None:
    heard: list[Msg] = []

    async def keep(msg: Msg) -> None:
        heard.append(msg)

    # acme's inboxes that globex aims at (all of `_INBOX_acme.>` also carries the replies to
    # requests that acme's own clients, the gateway among them, make meanwhile)
    targets = ("_INBOX_acme.forged", "_INBOX_acme.stolen")
    for subject in (sj.runs_subject("invalid", ACME), *targets, "plexrl.runs.acme.>"):
        await acme.nc.subscribe(subject, cb=keep)
    await flushed(acme.nc)
    with contextlib.suppress(APIError):  # refused once its quotas are full: then it has runs
        await submit(globex, GLOBEX, "run_globex_p")
    await eventually(lambda: _view_holds(globex))  # something in its own view to deliver
    for target in (
        sj.runs_subject("invalid", ACME),
        "_INBOX_acme.forged",
        sj.runs_subject("submit", ACME),
        sj.runs_subject("submit", GLOBEX),
    ):
        config = api.ConsumerConfig(
            name=f"relay_{uuid.uuid4().hex[:8]}",
            deliver_subject=target,
            deliver_policy=api.DeliverPolicy.ALL,
            ack_policy=api.AckPolicy.NONE,
        )
        await globex.js.add_consumer(sj.RUNS_STREAM, config)
    # a request whose reply subject is acme's: the answer goes to globex's account only
    await globex.nc.publish(
        sj.registry_list_subject(GLOBEX), b"{}", reply=sj.runs_subject("invalid", ACME)
    )
    await globex.nc.publish(sj.runs_subject("submit", GLOBEX), b"{}", reply="_INBOX_acme.stolen")
    await flushed(globex.nc)
    await asyncio.sleep(2.0)  # time for anything that could arrive to arrive
    assert heard == [], [(m.subject, m.data[:300]) for m in heard]
    await assert_unchanged(before, acme, services)


async def test_globexs_cancels_stop_none_of_acmes_generations(
    globex: Bus, acme: Bus, services: Bus, before: AcmeState
) -> None:
    # acme's generate request is in flight while globex, knowing its request id, sends
    # GenerateCancel for it on every cancel subject it can name, again and again
    request_id = f"acme-{uuid.uuid4().hex[:8]}"
    req = GenerateRequest(
        request_id=request_id,
        run_id=VICTIM_RUN,
        prompts=[[1, 5, 6, 7]],
        n=8,
        max_tokens=64,
        ignore_eos=True,
        timeout_s=60.0,
    )

    async def ask() -> Msg:
        for _ in range(600):  # the replica may still be starting when this test runs first
            with contextlib.suppress(NoRespondersError):
                return await acme.nc.request(sj.generate_subject(ACME), encode(req), 60.0)
            await asyncio.sleep(0.1)
        raise AssertionError("no inference replica answered")

    asking = asyncio.create_task(ask())
    forged = encode(GenerateCancel(request_id=request_id, reason="forged"))
    subjects = (sj.generate_subject(GLOBEX, "cancel"), sj.generate_subject(ACME, "cancel"))
    sent = 0
    while not asking.done():
        for subject in (*subjects, sj.CANCEL):
            with contextlib.suppress(Exception):  # a subject it may not name is its own loss
                await globex.nc.publish(subject, forged)
                sent += 1
        await asyncio.sleep(0.005)
    assert sent > 0
    reply: GenerateResponse = decode(asking.result().data, GenerateResponse)
    assert reply.error is None and reply.error_code is None, reply.error
    assert [len(c.token_ids) for c in reply.completions[0]] == [64] * 8
    await assert_unchanged(before, acme, services)


async def _view_holds(bus: Bus) -> bool:
    return (await bus.js.stream_info(sj.RUNS_STREAM)).state.messages > 0


# --- the plain attacks the broker refuses ---------------------------------------------------------


async def test_globex_hears_nothing_of_acme_and_reaches_no_services_api(
    deployment, globex: Bus, acme: Bus, services: Bus
) -> None:
    heard: list[str] = []

    async def keep(msg: Msg) -> None:
        heard.append(msg.subject)

    await globex.nc.subscribe(">", cb=keep)
    await flushed(globex.nc)
    await acme_still_works(acme)  # acme's traffic, every kind, while globex listens
    before = await acme_state(acme, services, VICTIM_RUN)
    assert not [s for s in heard if "acme" in s or s.startswith(("plexrl.rollouts", "$KV"))]
    names = [i.config.name for i in await globex.js.streams_info()]
    assert set(names) <= {sj.RUNS_STREAM, sj.WEIGHTS_STREAM}  # its own views, nothing else
    for subject in (
        f"$JS.API.STREAM.INFO.{sj.ROLLOUTS_STREAM}",
        f"$JS.API.DIRECT.GET.KV_{sj.KV_REGISTRY}.$KV.{sj.KV_REGISTRY}.{VICTIM_RUN}",
        f"{SERVICES_JS_PREFIX}.DIRECT.GET.{object_store_stream(ACME)}",
        f"{SERVICES_JS_PREFIX}.STREAM.INFO.{sj.RUNS_STREAM}",
        f"$JS.tenant_{ACME}.API.STREAM.INFO.{sj.RUNS_STREAM}",
        "$SYS.REQ.SERVER.PING",
        sj.registry_list_subject(ACME),
        sj.generate_subject(ACME),
    ):
        try:
            answer = await globex.nc.request(subject, b"{}", timeout=2)
        except (NoRespondersError, NatsTimeout):
            continue  # nothing there answers globex
        assert b"not found" in answer.data, (subject, answer.data)  # its own, empty JetStream
    with pytest.raises(NotFoundError):
        await globex.js.get_last_msg(sj.RUNS_STREAM, sj.runs_subject("discovered", ACME))
    with pytest.raises(Exception, match=r"[Aa]uthorization"):
        await nats.connect(deployment.broker.url, allow_reconnect=False, max_reconnect_attempts=0)
    await assert_unchanged(before, acme, services)


# --- the stock clients --------------------------------------------------------------------------


def test_the_stock_tinker_and_openai_clients_work_with_a_key_and_get_401_without(
    deployment,
) -> None:
    import openai
    import tinker

    key = deployment.key(ACME)
    client = openai.OpenAI(base_url=f"{deployment.gateway}/v1", api_key=key, max_retries=0)
    assert "tiny-base" in [m.id for m in client.models.list()]
    done = client.completions.create(model="tiny-base", prompt="ab", max_tokens=2)
    assert done.choices[0].finish_reason in ("length", "stop")
    wrong = openai.OpenAI(
        base_url=f"{deployment.gateway}/v1", api_key="tml-plexrl-wrong", max_retries=0
    )
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    rest = tinker.RestClient(base_url=deployment.gateway, api_key=key)
    models = rest.get_server_capabilities().result().supported_models
    assert [m.model_name for m in models] == ["tiny-base"]
    with pytest.raises(tinker.AuthenticationError, match="401"):
        refused = tinker.RestClient(base_url=deployment.gateway, api_key="tml-plexrl-wrong")
        refused.get_server_capabilities().result()
