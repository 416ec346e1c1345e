"""The bus on a three-server JetStream cluster that loses its quorum (two servers SIGKILLed):
which errors say "JetStream unavailable" (:func:`services.bus.retry.unavailable`), and how a
publish, an ack and a KV read wait them out, logging the wait once and the resumption once,
with the publish stored exactly once. Real nats-servers, no mocks."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import pytest
from nats.js import api
from nats.js.errors import APIError, NotFoundError

from schemas import RunEvicted
from services.bus import Bus, Consumer, EmbeddedNats, free_port
from services.bus.retry import unavailable

if TYPE_CHECKING:
    from tests.conftest import PauseCounts

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]
T = TypeVar("T")

STREAM, SUBJECT, BUCKET = "T_QUORUM", "t.quorum.evicted", "t-quorum"
WAITING = "JetStream has no quorum: only 1 of 3 NATS servers reachable"
RESUMED = "JetStream answers again: resumed after"


class NatsCluster:
    """Three nats-servers routed to one another on loopback, each on a store of its own (the
    fault suite's tests/faults/cluster.py has the full version)."""

    def __init__(self, root: Path, size: int = 3) -> None:
        routes = [free_port() for _ in range(size)]
        self.nodes = []
        for i in range(size):
            others = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes if p != routes[i])
            config = (
                f"server_name: n{i}\ncluster {{\n  name: t\n  listen: 127.0.0.1:{routes[i]}\n"
                f"  routes: [{others}]\n}}\n"
            )
            self.nodes.append(EmbeddedNats(store_dir=root / f"n{i}", extra_config=config))

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    nodes = NatsCluster(tmp_path / "nats")
    for node in nodes.nodes:
        node.start()
    yield nodes
    for node in nodes.nodes:
        node.kill()


@pytest.fixture
async def admin(cluster: NatsCluster) -> AsyncIterator[Bus]:
    """A client that does not wait out an outage (a client command's ``outage_wait`` of 0),
    with a stream of three replicas, a KV bucket of three, and both with a leader."""
    bus = await Bus.connect(cluster.url, "admin", provision_streams=False, wait=30)
    for _ in range(100):  # the meta leader may still settle
        try:
            await bus.js.add_stream(name=STREAM, subjects=[f"{SUBJECT}.>"], num_replicas=3)
            await bus.js.create_key_value(bucket=BUCKET, replicas=3)
            break
        except Exception:
            await asyncio.sleep(0.2)
    kv = await bus.js.key_value(BUCKET)
    await kv.put("k", b"v")
    await bus.publish(
        f"{SUBJECT}.first", RunEvicted(run_id="run_x", idx=0, reason="r"), msg_id="first"
    )
    yield bus
    await bus.close()


def _lose_quorum(cluster: NatsCluster, leader: str = "n0") -> list[int]:
    """SIGKILL ``leader`` (a server name, ``n<i>``) and one other server; their indices."""
    first = int(leader.removeprefix("n"))
    down = [first, (first + 1) % len(cluster.nodes)]
    for i in down:
        cluster.nodes[i].kill()
    return down


def _restore(cluster: NatsCluster, down: list[int]) -> None:
    for i in down:
        cluster.nodes[i].start()


async def test_what_a_cluster_without_quorum_raises_is_unavailable_and_answers_are_not(
    cluster: NatsCluster, admin: Bus
) -> None:
    kv = await admin.js.key_value(BUCKET)
    down = _lose_quorum(cluster)
    event = RunEvicted(run_id="run_x", idx=0, reason="r")
    # a write needs a quorum: it fails, whatever the client hears
    with pytest.raises(Exception) as refused:
        await admin.publish(f"{SUBJECT}.x", event, attempts=1, timeout=1.0)
    seen: list[BaseException] = [refused.value]
    # reads may still be answered for a moment (by a leader that has not stepped down yet, or
    # a replica's direct get); whatever fails must fail as unavailable
    reads = [
        admin.js.stream_info(STREAM),
        kv.get("k"),
        admin.js.consumers_info(STREAM),
        admin.js.account_info(),
    ]
    for failed in await asyncio.gather(*reads, return_exceptions=True):
        if isinstance(failed, BaseException):
            seen.append(failed)
    assert all(unavailable(exc) for exc in seen), [repr(e) for e in seen]
    # the client's bounded wait (outage_wait) ends with the last unavailable error
    with pytest.raises(Exception) as bounded:
        await admin.until_available(
            lambda: admin.js.publish(f"{SUBJECT}.y", b"", timeout=0.5), "a write", outage_wait=1.0
        )
    assert unavailable(bounded.value)

    _restore(cluster, down)

    async def once_available(operation: Callable[[], Awaitable[T]]) -> T:
        return await admin.until_available(operation, "after the restart", outage_wait=60)

    # answers are raised at once, never waited on
    with pytest.raises(NotFoundError) as missing:
        await once_available(lambda: admin.js.stream_info("T_NO_SUCH_STREAM"))
    assert not unavailable(missing.value)
    await once_available(
        lambda: admin.js.add_stream(
            name="T_FULL", subjects=["t.full"], max_msgs=1, discard=api.DiscardPolicy.NEW
        )
    )
    await once_available(lambda: admin.js.publish("t.full", b"1", headers={"Nats-Msg-Id": "1"}))
    with pytest.raises(APIError) as full:
        await once_available(lambda: admin.js.publish("t.full", b"2"))
    assert full.value.err_code == 10077 and not unavailable(full.value)


async def test_a_publish_and_an_ack_wait_out_the_loss_of_quorum_and_count_once(
    cluster: NatsCluster, admin: Bus, caplog: pytest.LogCaptureFixture, pause_metrics: PauseCounts
) -> None:
    caplog.set_level(logging.WARNING, logger="services.bus.retry")
    service = await Bus.connect(
        cluster.url, "svc", provision_streams=False, wait=30, outage_wait=math.inf
    )
    consumer = Consumer(
        service,
        stream=STREAM,
        durable="t_quorum",
        filter_subject=f"{SUBJECT}.>",
        event_type=RunEvicted,
        ack_wait=60.0,
    )
    tasks: list[asyncio.Task] = []
    try:
        ((_, delivery),) = await consumer.fetch(batch=1, timeout=5.0)
        kv = await service.js.key_value(BUCKET)
        # the consumer's leader goes: a leader left alone may still answer an ack for a while
        # (until it notices it lost its quorum), the survivor cannot take over without one
        info = await admin.js.consumer_info(STREAM, "t_quorum")
        assert info.cluster is not None and info.cluster.leader
        down = _lose_quorum(cluster, info.cluster.leader)
        event = RunEvicted(run_id="run_x", idx=1, reason="during the outage")
        # attempts=2: the quick retries are over long before the servers come back
        publishing = asyncio.create_task(
            service.publish(f"{SUBJECT}.second", event, msg_id="second", attempts=2, timeout=1.0)
        )
        acking = asyncio.create_task(delivery.ack())
        # a read may be answered by a replica meanwhile (direct get); if not, it waits too
        reading = asyncio.create_task(service.until_available(lambda: kv.get("k"), "a KV read"))
        tasks += [publishing, acking, reading]

        def waiting() -> tuple[list[str], list[str]]:
            said = [r.getMessage() for r in caplog.records if WAITING in r.getMessage()]
            return (
                [m for m in said if "publishing RunEvicted to t.quorum.evicted.second" in m],
                [m for m in said if "acknowledging t.quorum.evicted.first" in m],
            )

        for _ in range(200):  # each is reported REPORT_AFTER s after its first failure
            if all(waiting()):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(3.0)  # a few more tries each, still without a quorum
        assert not (publishing.done() or acking.done())
        # one line per waiting operation, however many times it was tried
        publish_waits, ack_waits = waiting()
        assert len(publish_waits) == 1 and len(ack_waits) == 1, (publish_waits, ack_waits)
        # the metric counts the waits the log reported (the read's perhaps too)
        now = pause_metrics("plexrl_paused_operations")[("jetstream_unavailable", "jetstream")]
        assert now >= 2, now

        _restore(cluster, down)
        ack = await asyncio.wait_for(publishing, 60)
        await asyncio.wait_for(acking, 60)
        assert (await asyncio.wait_for(reading, 60)).value == b"v"
        # each wait logged (the read's perhaps only now) is followed by one resumption
        said = [r.getMessage() for r in caplog.records]
        waited = [m.partition(": JetStream ")[0] for m in said if "; waiting for" in m]
        resumed = [m.partition(": JetStream ")[0] for m in said if RESUMED in m]
        assert sorted(waited) == sorted(resumed), said

        # every wait is over: the metric is back to 0, and counted each wait once
        assert pause_metrics("plexrl_paused_operations") == {
            ("jetstream_unavailable", "jetstream"): 0
        }
        assert pause_metrics("plexrl_pauses")[("jetstream_unavailable", "jetstream")] == len(
            [r for r in caplog.records if WAITING in r.getMessage()]
        )
        # stored once: the same message id again is a duplicate, and the stream holds two
        again = await service.publish(f"{SUBJECT}.second", event, msg_id="second")
        assert again.duplicate and again.seq == ack.seq
        info = await admin.js.stream_info(STREAM)
        assert info.state.messages == 2
        # the ack held: nothing pending, nothing to redeliver
        consumer_info = await admin.js.consumer_info(STREAM, "t_quorum")
        assert consumer_info.ack_floor is not None and consumer_info.ack_floor.stream_seq == 1
        assert consumer_info.num_ack_pending == 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await consumer.close()
        await service.close()


PROBE = """
import asyncio, sys
from schemas import RunEvicted
from services.launch.process import run_service

async def serve(bus, stop):
    n = 0
    while not stop.is_set():
        n += 1
        event = RunEvicted(run_id="run_x", idx=n, reason="probe")
        await bus.publish("t.quorum.evicted.probe", event, msg_id=f"probe-{n}", timeout=1.0)
        print("published", n, flush=True)
        await asyncio.sleep(0.2)

sys.exit(run_service("probe", serve, nats_url=sys.argv[1], service="probe"))
"""


async def test_sigterm_during_the_wait_stops_the_service_with_status_1(
    cluster: NatsCluster, admin: Bus, tmp_path: Path
) -> None:
    """A service SIGTERMed while it waits out the loss of quorum stops (status 1, saying what it
    left undone) instead of waiting for servers that may not come back: a SIGTERM is how an
    operator or an orchestrator of containers takes a service down."""
    out, err = tmp_path / "probe.out", tmp_path / "probe.err"
    with out.open("wb") as o, err.open("wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-c", PROBE, cluster.url],
            cwd=REPO,
            stdout=o,
            stderr=e,
            env=os.environ | {"PLEXRL_CONNECT_WAIT_S": "30"},
        )
    try:
        for _ in range(300):
            if "published 3" in out.read_text():
                break
            assert proc.poll() is None, err.read_text()
            await asyncio.sleep(0.1)
        info = await admin.js.stream_info(STREAM)
        assert info.cluster is not None and info.cluster.leader
        _lose_quorum(cluster, info.cluster.leader)
        for _ in range(300):
            if WAITING in err.read_text():
                break
            await asyncio.sleep(0.1)
        assert WAITING in err.read_text(), err.read_text()
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        status = await asyncio.to_thread(proc.wait, 30)
        print(f"stopped {time.monotonic() - sent:.1f}s after the SIGTERM")
        said = err.read_text()
        assert status == 1, said
        assert "asked to stop after waiting" in said and "for JetStream; not done" in said, said
        assert "plexrl probe:" in said and "Traceback" not in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
