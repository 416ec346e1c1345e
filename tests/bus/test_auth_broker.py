"""The broker's tenant isolation, measured against a real nats-server running the config of
``plexrl nats-config``: two tenants (acme, beta) and the services' user.

nats-py is used directly, not the services, so these tests check the server configuration
itself: every action beta must not take against acme's things is refused by the broker (a
permission violation on beta's connection, a request that nobody answers) and changes nothing;
every action acme needs on its own things works.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from services.tenants.permissions import object_store_stream

from schemas import subjects as sj
from schemas.tenant import inbox_prefix
from schemas.training import TRAIN_WILDCARD, train_subject
from services.bus import EmbeddedNats, flushed, provision
from services.config.tenants import TenantQuota, TenantsFile, save_tenants
from services.tenants.credentials import SERVICES, ensure_seed, seed_path
from services.tenants.nats_config import render_authorization, users_of

ACME, BETA = "acme", "beta"
RUN = "run_a1"
RUN2 = "run_a2"  # only the services publish on its weights subject
OBJECT = f"{RUN}/step_1"
OBJECT_BYTES = os.urandom(300_000)  # three chunks
SUBMIT = json.dumps({"type": "run_submitted", "run_id": RUN, "config": {}}).encode()
REPO = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")
# How long an answer the broker allows may take: generous, because CI runs this file beside
# trainers and servers on two cores; a refusal never waits this long (it is an error or silence).
ANSWER_S = 30.0


@dataclass
class Client:
    """One user's connection and what the broker told it went wrong."""

    nc: NATS
    errors: list[str] = field(default_factory=list)

    async def violation(self, subject: str, timeout: float = 3.0) -> str:
        """Wait for the broker's permission violation that names ``subject``."""
        await flushed(self.nc, timeout=30)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            for e in self.errors:
                if "permissions violation" in e.lower() and f'"{subject}"'.lower() in e.lower():
                    return e.lower()
            await asyncio.sleep(0.02)
        raise AssertionError(f"no permission violation for {subject!r}; errors: {self.errors}")


@dataclass
class Broker:
    server: EmbeddedNats
    auth_dir: Path
    services: Client
    generate_requests: list[Msg]


async def connect(url: str, auth_dir: Path, user: str) -> Client:
    client = Client(nc=NATS())

    async def on_error(exc: Exception) -> None:
        client.errors.append(str(exc))

    prefix = {} if user == SERVICES else {"inbox_prefix": inbox_prefix(user)}
    await client.nc.connect(
        url,
        nkeys_seed=str(seed_path(auth_dir, user)),
        error_cb=on_error,
        allow_reconnect=False,
        **prefix,
    )
    return client


@pytest.fixture(scope="module")
def auth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("auth")
    save_tenants(
        d / "tenants.toml", TenantsFile(tenants={ACME: TenantQuota(), BETA: TenantQuota()})
    )
    for tenant in (ACME, BETA):
        ensure_seed(seed_path(d, tenant))
    return d


@pytest.fixture(scope="module")
def auth_server(auth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    authorization = render_authorization(users_of(auth_dir))
    with EmbeddedNats(
        store_dir=tmp_path_factory.mktemp("authjs"), extra_config=authorization
    ) as server:
        yield server


@pytest.fixture(scope="module")
async def broker(auth_server: EmbeddedNats, auth_dir: Path) -> AsyncIterator[Broker]:
    """The services provision everything and put data of acme's in each place."""
    svc = await connect(auth_server.url, auth_dir, SERVICES)
    js = svc.nc.jetstream()
    await provision(js)
    for tenant in (ACME, BETA):
        await js.create_object_store(sj.weights_bucket(tenant))
    acme_store = await js.object_store(sj.weights_bucket(ACME))
    await acme_store.put(OBJECT, OBJECT_BYTES)
    await js.publish(sj.runs_subject("submit", ACME), SUBMIT)
    await js.publish(sj.runs_subject("discovered", ACME), b'{"type":"run_discovered"}')
    await js.publish(sj.tenant_rollouts_subject(RUN, ACME), b'{"type":"rollout_batch"}')
    await js.publish(sj.tenant_weights_subject(RUN, ACME), b'{"type":"weights_ready"}')
    for step in (1, 2):
        await js.publish(sj.tenant_weights_subject(RUN2, ACME), b'{"step":%d}' % step)
    await js.publish(sj.errors_subject("registry"), b'{"type":"invalid_message"}')
    kv = await js.key_value(sj.KV_REGISTRY)
    await kv.put(RUN, b'{"tenant":"acme"}')
    requests: list[Msg] = []

    async def answer(msg: Msg) -> None:
        requests.append(msg)
        await msg.respond(b"answered " + msg.subject.encode())

    await svc.nc.subscribe("plexrl.inference.*.generate", cb=answer)
    await svc.nc.subscribe("plexrl.registry.*.list", cb=answer)
    await svc.nc.subscribe(TRAIN_WILDCARD, cb=answer)
    await flushed(svc.nc)
    yield Broker(auth_server, auth_dir, svc, requests)
    await svc.nc.close()


@pytest.fixture
async def beta(broker: Broker) -> AsyncIterator[Client]:
    client = await connect(broker.server.url, broker.auth_dir, BETA)
    yield client
    await client.nc.close()


@pytest.fixture
async def acme(broker: Broker) -> AsyncIterator[Client]:
    client = await connect(broker.server.url, broker.auth_dir, ACME)
    yield client
    await client.nc.close()


async def everything_stored(broker: Broker) -> dict[str, tuple[int, int]]:
    """Every stream of the account (KV and object stores too): its message count, last seq."""
    jsm = broker.services.nc.jetstream()
    out = {}
    for name in await jsm.streams_info():
        out[name.config.name] = (name.state.messages, name.state.last_seq)
    return out


# --- what beta must not do ---------------------------------------------------------------------

ACME_OBJ = object_store_stream(ACME)
ACME_META = f"$O.{sj.weights_bucket(ACME)}.M.{base64.urlsafe_b64encode(OBJECT.encode()).decode()}"


def consumer_create(stream: str, filter_subject: str) -> tuple[str, bytes]:
    body = {
        "stream_name": stream,
        "config": {
            "name": "spy",
            "filter_subject": filter_subject,
            "deliver_subject": "_INBOX_beta.spy",
            "ack_policy": "none",
        },
    }
    return f"$JS.API.CONSUMER.CREATE.{stream}.spy.{filter_subject}", json.dumps(body).encode()


DENIED_PUBLISH = [
    sj.runs_subject("submit", ACME),
    sj.runs_subject("evict", ACME),
    sj.tenant_rollouts_subject(RUN, ACME),
    sj.SUBMIT,  # the default tenant's, whose runs the services treat as their own
    sj.EVICT,
    sj.tenant_rollouts_subject(RUN),
    sj.runs_subject("discovered", BETA),  # lifecycle events come from the registry only
    sj.tenant_weights_subject(RUN, BETA),  # weights announcements come from the trainer only
    f"$O.{sj.weights_bucket(BETA)}.C.x",  # no writing into an object store, not even its own
    f"$O.{sj.weights_bucket(ACME)}.M.x",
    f"$KV.{sj.KV_REGISTRY}.{RUN}",
]


@pytest.mark.parametrize("subject", DENIED_PUBLISH)
async def test_beta_cannot_publish_on_subjects_that_are_not_its_own(
    broker: Broker, beta: Client, subject: str
) -> None:
    before = await everything_stored(broker)
    await beta.nc.publish(subject, SUBMIT)
    assert "publish to" in await beta.violation(subject)
    assert await everything_stored(broker) == before


DENIED_REQUESTS = {
    "generate as acme": (sj.generate_subject(ACME), b"{}"),
    "generate as the default tenant": (sj.GENERATE, b"{}"),
    "list acme's runs": (sj.registry_list_subject(ACME), b"{}"),
    "train acme's runs": (train_subject("forward_backward", ACME), b"{}"),
    "train as the default tenant": (train_subject("optim_step"), b"{}"),
    "consumer on acme's runs": consumer_create(sj.RUNS_STREAM, "plexrl.runs.acme.>"),
    "consumer on acme's weights": consumer_create(sj.WEIGHTS_STREAM, "plexrl.weights.acme.>"),
    "consumer on acme's rollouts": consumer_create(sj.ROLLOUTS_STREAM, "plexrl.rollouts.acme.>"),
    "consumer on every run": consumer_create(sj.RUNS_STREAM, "plexrl.runs.>"),
    "consumer without a filter in the subject": (
        f"$JS.API.CONSUMER.CREATE.{sj.RUNS_STREAM}",
        consumer_create(sj.RUNS_STREAM, "plexrl.runs.beta.>")[1],
    ),
    "durable consumer": (f"$JS.API.CONSUMER.DURABLE.CREATE.{sj.RUNS_STREAM}.spy", b"{}"),
    "direct get of acme's submit": (
        f"$JS.API.DIRECT.GET.{sj.RUNS_STREAM}.{sj.runs_subject('submit', ACME)}",
        b"",
    ),
    "direct get of acme's rollouts": (
        f"$JS.API.DIRECT.GET.{sj.ROLLOUTS_STREAM}.{sj.tenant_rollouts_subject(RUN, ACME)}",
        b"",
    ),
    "direct get of acme's weights": (
        f"$JS.API.DIRECT.GET.{sj.WEIGHTS_STREAM}.{sj.tenant_weights_subject(RUN, ACME)}",
        b"",
    ),
    # a direct-get answer goes to any reply subject and is stored there: not even its own
    "direct get of its own submit": (
        f"$JS.API.DIRECT.GET.{sj.RUNS_STREAM}.{sj.runs_subject('submit', BETA)}",
        b"",
    ),
    "direct get by sequence": (f"$JS.API.DIRECT.GET.{sj.RUNS_STREAM}", b'{"seq": 1}'),
    "message get": (f"$JS.API.STREAM.MSG.GET.{sj.RUNS_STREAM}", b'{"seq": 1}'),
    "acme's object store info": (f"$JS.API.STREAM.INFO.{ACME_OBJ}", b""),
    "acme's object metadata": (f"$JS.API.STREAM.MSG.GET.{ACME_OBJ}", b'{"seq": 1}'),
    "acme's object direct get": (f"$JS.API.DIRECT.GET.{ACME_OBJ}.{ACME_META}", b""),
    "acme's object chunks": (f"$JS.API.CONSUMER.CREATE.{ACME_OBJ}", b"{}"),
    "the run table": (
        f"$JS.API.DIRECT.GET.KV_{sj.KV_REGISTRY}.$KV.{sj.KV_REGISTRY}.{RUN}",
        b"",
    ),
    "the run table's stream": (f"$JS.API.STREAM.INFO.KV_{sj.KV_REGISTRY}", b""),
    "progress": (f"$JS.API.STREAM.MSG.GET.KV_{sj.KV_PROGRESS}", b'{"seq": 1}'),
    "the errors stream": (f"$JS.API.STREAM.INFO.{sj.ERRORS_STREAM}", b""),
    "a consumer on the errors": consumer_create(sj.ERRORS_STREAM, "plexrl.errors.>"),
    "stream names": ("$JS.API.STREAM.NAMES", b"{}"),
    "stream list": ("$JS.API.STREAM.LIST", b"{}"),
    "account info": ("$JS.API.INFO", b""),
    "create a stream": ("$JS.API.STREAM.CREATE.SPY", b'{"name":"SPY","subjects":[">"]}'),
    "purge acme's runs": (
        f"$JS.API.STREAM.PURGE.{sj.RUNS_STREAM}",
        b'{"filter":"plexrl.runs.acme.>"}',
    ),
    "delete the runs stream": (f"$JS.API.STREAM.DELETE.{sj.RUNS_STREAM}", b""),
}


@pytest.mark.parametrize("action", sorted(DENIED_REQUESTS))
async def test_beta_requests_on_acme_or_the_services_get_no_answer(
    broker: Broker, beta: Client, action: str
) -> None:
    subject, body = DENIED_REQUESTS[action]
    before = await everything_stored(broker)
    answered = len(broker.generate_requests)
    with pytest.raises((NatsTimeout, NoRespondersError)):
        await beta.nc.request(subject, body, timeout=0.5)
    assert "publish to" in await beta.violation(subject)
    assert len(broker.generate_requests) == answered
    assert await everything_stored(broker) == before


async def test_a_consumer_create_whose_body_filter_differs_from_its_subject_is_refused(
    broker: Broker, beta: Client
) -> None:
    subject, _ = consumer_create(sj.RUNS_STREAM, "plexrl.runs.beta.>")
    _, body_for_acme = consumer_create(sj.RUNS_STREAM, "plexrl.runs.acme.>")
    reply = await beta.nc.request(subject, body_for_acme, timeout=ANSWER_S)
    error = json.loads(reply.data)["error"]
    assert error["code"] == 400
    assert "filter" in error["description"]
    info = await broker.services.nc.jetstream().stream_info(sj.RUNS_STREAM)
    assert info.state.consumer_count == 0


DENIED_SUBSCRIBE = [
    "plexrl.runs.acme.>",
    sj.tenant_weights_subject(RUN, ACME),
    "plexrl.rollouts.acme.*",
    "plexrl.runs.>",
    "plexrl.errors.>",
    f"$KV.{sj.KV_REGISTRY}.>",
    f"$O.{sj.weights_bucket(ACME)}.>",
    "_INBOX.>",
    f"{inbox_prefix(ACME)}.>",
    ">",
]


@pytest.mark.parametrize("subject", DENIED_SUBSCRIBE)
async def test_beta_cannot_listen_to_acme_or_to_everyone(
    broker: Broker, beta: Client, subject: str
) -> None:
    got: list[Msg] = []

    async def keep(msg: Msg) -> None:
        got.append(msg)

    await beta.nc.subscribe(subject, cb=keep)
    assert "subscription to" in await beta.violation(subject)
    await broker.services.nc.publish(sj.tenant_weights_subject(RUN, ACME), b"core")
    await broker.services.nc.publish(f"{inbox_prefix(ACME)}.x", b"core")
    await flushed(broker.services.nc)
    await asyncio.sleep(0.1)
    assert got == []


# --- what acme may do with its own things --------------------------------------------------------


async def test_acme_publishes_its_own_submit_and_rollouts_and_gets_a_pub_ack(
    acme: Client,
) -> None:
    js = acme.nc.jetstream()
    ack = await js.publish(sj.runs_subject("submit", ACME), SUBMIT)
    assert ack.stream == sj.RUNS_STREAM and ack.seq > 0
    ack = await js.publish(sj.runs_subject("evict", ACME), b'{"type":"evict_requested"}')
    assert ack.stream == sj.RUNS_STREAM
    ack = await js.publish(sj.tenant_rollouts_subject(RUN, ACME), b'{"type":"rollout_batch"}')
    assert ack.stream == sj.ROLLOUTS_STREAM
    assert acme.errors == []


async def _replay(
    client: Client,
    stream: str,
    subject: str,
    deliver_policy: api.DeliverPolicy = api.DeliverPolicy.ALL,
) -> list[Msg]:
    """Every message an ordered consumer named in its API subject delivers within a moment."""
    js = client.nc.jetstream()
    got: list[Msg] = []

    async def keep(msg: Msg) -> None:
        got.append(msg)

    sub = await js.subscribe(
        subject,
        stream=stream,
        cb=keep,
        ordered_consumer=True,
        config=api.ConsumerConfig(
            name=f"replay_{os.urandom(4).hex()}", deliver_policy=deliver_policy
        ),
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while loop.time() < deadline and (not got or got[-1].metadata.num_pending):
        await asyncio.sleep(0.02)
    await sub.unsubscribe()
    return got


async def test_acme_replays_its_runs_rollouts_and_weights(broker: Broker, acme: Client) -> None:
    runs = await _replay(acme, sj.RUNS_STREAM, "plexrl.runs.acme.>")
    subjects = [m.subject for m in runs]
    assert sj.runs_subject("submit", ACME) in subjects
    assert sj.runs_subject("discovered", ACME) in subjects
    assert all(s.startswith("plexrl.runs.acme.") for s in subjects)
    rollouts = await _replay(acme, sj.ROLLOUTS_STREAM, "plexrl.rollouts.acme.>")
    assert rollouts and rollouts[0].data == b'{"type":"rollout_batch"}'
    last = await _replay(
        acme,
        sj.WEIGHTS_STREAM,
        sj.tenant_weights_subject(RUN2, ACME),
        deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
    )
    assert [m.data for m in last] == [b'{"step":2}']
    assert acme.errors == []


async def test_acme_reads_its_own_object_store(broker: Broker, acme: Client) -> None:
    """What nats-py's ObjectStore needs, less the stream lookup by subject (which lists every
    stream): the object's metadata, then an ordered consumer bound to the store's stream."""
    js = acme.nc.jetstream()
    store = await js.object_store(sj.weights_bucket(ACME))
    info = await store.get_info(OBJECT)
    assert info.size == len(OBJECT_BYTES)
    sub = await js.subscribe(
        f"$O.{sj.weights_bucket(ACME)}.C.{info.nuid}", stream=ACME_OBJ, ordered_consumer=True
    )
    data = b""
    while len(data) < info.size:
        data += (await sub.next_msg(timeout=ANSWER_S)).data
    await sub.unsubscribe()
    assert data == OBJECT_BYTES
    direct = await acme.nc.request(
        f"$JS.API.DIRECT.GET.{ACME_OBJ}.{ACME_META}", b"", timeout=ANSWER_S
    )
    assert json.loads(direct.data)["nuid"] == info.nuid
    assert acme.errors == []


async def test_acme_requests_on_its_own_subjects_are_answered(broker: Broker, acme: Client) -> None:
    reply = await acme.nc.request(sj.generate_subject(ACME), b"{}", timeout=ANSWER_S)
    assert reply.data == f"answered {sj.generate_subject(ACME)}".encode()
    assert broker.generate_requests[-1].reply.startswith(inbox_prefix(ACME) + ".")
    reply = await acme.nc.request(sj.registry_list_subject(ACME), b"{}", timeout=ANSWER_S)
    assert reply.data == f"answered {sj.registry_list_subject(ACME)}".encode()
    for kind in ("forward_backward", "optim_step", "save_weights", "load_weights"):
        subject = train_subject(kind, ACME)
        reply = await acme.nc.request(subject, b"{}", timeout=ANSWER_S)
        assert reply.data == f"answered {subject}".encode()
    assert acme.errors == []


async def test_acme_hears_core_publishes_on_its_weights(broker: Broker, acme: Client) -> None:
    sub = await acme.nc.subscribe(f"plexrl.weights.{ACME}.>")
    await flushed(acme.nc)  # nc.flush() alone can return before the server has the SUB
    await broker.services.nc.publish(sj.tenant_weights_subject(RUN, ACME), b"ready")
    assert (await sub.next_msg(timeout=ANSWER_S)).data == b"ready"
    assert acme.errors == []


async def test_a_client_without_a_known_key_is_refused(broker: Broker, tmp_path: Path) -> None:
    ensure_seed(tmp_path / "stranger.nk")
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    with pytest.raises(Exception, match=r"(?i)authorization violation"):
        await nats.connect(
            broker.server.url,
            nkeys_seed=str(tmp_path / "stranger.nk"),
            allow_reconnect=False,
            error_cb=on_error,
        )
    with pytest.raises(Exception, match=r"(?i)authorization violation"):
        await nats.connect(broker.server.url, allow_reconnect=False, error_cb=on_error)


# --- the same from Node.js -------------------------------------------------------------------------


@pytest.mark.skipif(
    NODE is None or not (REPO / "tests/js/node_modules/@nats-io/transport-node").is_dir(),
    reason="needs node and `npm install --prefix tests/js`",
)
def test_node_client_is_held_to_the_same_permissions(broker: Broker) -> None:
    assert NODE is not None
    env = os.environ | {
        "PLEXRL_TEST_NATS_URL": broker.server.url,
        "PLEXRL_TEST_SEED": str(seed_path(broker.auth_dir, BETA)),
        "PLEXRL_TEST_TENANT": BETA,
        "PLEXRL_TEST_OTHER_TENANT": ACME,
    }
    answered = len(broker.generate_requests)
    proc = subprocess.run(
        [NODE, "--test", "tenants.test.mjs"],
        cwd=REPO / "tests/js",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout
    assert "# skipped 0" in proc.stdout
    assert int(proc.stdout.split("# pass ")[1].split()[0]) == 5
    # what the Node.js client tried reached no service
    assert len(broker.generate_requests) == answered
