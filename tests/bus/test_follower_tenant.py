"""A tenant's follower under the broker's per-user permissions, across a server restart.

The server runs with two users in one account: ``admin`` may do anything, ``acme`` may only
create consumers through the API subject that names its own filter, read the last message of
its own subjects, answer flow control and receive on its own inboxes. A tenant's follower must
create (and, after the restart, recreate) its consumer within those permissions.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS

from schemas import RunEvicted
from schemas import subjects as sj
from services.bus import Bus, Follower, MessageMeta, find_nats_server, free_port, provision

PERMISSIONS = """
authorization {
  users = [
    {user: admin, password: admin}
    {user: acme, password: acme, permissions: {
      publish: {allow: [
        "$JS.API.CONSUMER.CREATE.PLEXRL_RUNS.*.plexrl.runs.acme.>",
        "$JS.FC.>"
      ]}
      subscribe: {allow: ["_INBOX_acme.>"]}
    }}
  ]
}
"""


class PermissionedNats:
    """A nats-server with the users above, restartable on the same port and store."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)
        (root / "nats.conf").write_text(
            f"listen: 127.0.0.1:{self.port}\n"
            f'jetstream {{\n  store_dir: "{root / "js"}"\n  sync_interval: always\n}}\n'
            + PERMISSIONS
        )

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.root / "nats-server.log", "ab")  # noqa: SIM115 - lives with the process
        self.proc = subprocess.Popen(
            [find_nats_server(), "-c", str(self.root / "nats.conf")],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[PermissionedNats]:
    server = PermissionedNats(tmp_path / "nats")
    server.start()
    yield server
    server.kill()


async def _quiet(exc: Exception) -> None:
    pass


async def _connect(url: str, user: str, **kw: object) -> NATS:
    for _ in range(100):  # the server may still be starting
        try:
            return await nats.connect(
                url,
                user=user,
                password=user,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.2,
                allow_reconnect=True,
                error_cb=_quiet,
                **kw,  # type: ignore[arg-type]
            )
        except Exception:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"cannot connect to {url} as {user}")


@pytest.fixture
async def buses(broker: PermissionedNats) -> AsyncIterator[tuple[Bus, Bus]]:
    admin = Bus(await _connect(broker.url, "admin"), "test")
    await provision(admin.js)
    acme = Bus(await _connect(broker.url, "acme", inbox_prefix="_INBOX_acme"), "acme-client")
    yield admin, acme
    for bus in (acme, admin):
        if not bus.nc.is_closed:
            await bus.nc.close()


def _evicted(i: int, tenant: str) -> RunEvicted:
    return RunEvicted(run_id=f"run_{tenant}_{i}", idx=i, reason="tenant test", tenant=tenant)


async def test_a_tenant_follower_keeps_following_across_a_server_restart(
    broker: PermissionedNats, buses: tuple[Bus, Bus]
) -> None:
    admin, acme = buses
    await admin.publish(sj.runs_subject("evicted", "acme"), _evicted(0, "acme"))
    await admin.publish(sj.runs_subject("evicted", "beta"), _evicted(1, "beta"))
    got: list[tuple[int, RunEvicted, MessageMeta]] = []
    follower: Follower[RunEvicted] = Follower(
        acme,
        sj.RUNS_STREAM,
        "plexrl.runs.acme.>",
        RunEvicted,
        lambda seq, event, meta: got.append((seq, event, meta)),
        heartbeat=0.5,
        tenant="acme",
    )
    await follower.start()
    await follower.wait_until_caught_up(
        5.0
    )  # the last sequence comes through a one-message consumer
    assert [e.run_id for _, e, _ in got] == ["run_acme_0"]

    broker.kill()
    await asyncio.sleep(0.3)
    broker.start()  # same port and store: the stream survives, the consumer does not
    await admin.publish(sj.runs_subject("evicted", "beta"), _evicted(2, "beta"))
    for i in (3, 4):
        await admin.publish(sj.runs_subject("evicted", "acme"), _evicted(i, "acme"))
    assert await follower.wait(lambda: len(got) == 3, 20.0)
    assert [e.run_id for _, e, _ in got] == ["run_acme_0", "run_acme_3", "run_acme_4"]
    assert [meta.subject for _, _, meta in got] == ["plexrl.runs.acme.evicted"] * 3
    await follower.stop()


async def test_an_unnamed_consumer_is_refused_by_the_broker(buses: tuple[Bus, Bus]) -> None:
    """Why a tenant's follower names its consumer: the anonymous create subject is not its own."""
    _, acme = buses
    acme.js = acme.nc.jetstream(timeout=1.0)
    follower: Follower[RunEvicted] = Follower(
        acme, sj.RUNS_STREAM, "plexrl.runs.acme.>", RunEvicted, lambda *_: None, tenant="default"
    )
    with pytest.raises(nats.errors.TimeoutError):
        await follower.start()


async def test_a_tenant_follower_survives_a_reset_while_its_consumer_lives(
    buses: tuple[Bus, Bus],
) -> None:
    """nats-py recreates an ordered consumer after a gap or missed heartbeats, while the old
    one still exists on the server; the new one must not reuse its name."""
    admin, acme = buses
    await admin.publish(sj.runs_subject("evicted", "acme"), _evicted(0, "acme"))
    got: list[RunEvicted] = []
    follower: Follower[RunEvicted] = Follower(
        acme,
        sj.RUNS_STREAM,
        "plexrl.runs.acme.>",
        RunEvicted,
        lambda seq, event, meta: got.append(event),
        tenant="acme",
    )
    await follower.start()
    assert await follower.wait(lambda: len(got) == 1, 5.0)
    # What nats-py does on a sequence gap: a new deliver subject, a consumer from the next one.
    await follower._sub._sub._jsi.reset_ordered_consumer(follower.seq + 1)
    await admin.publish(sj.runs_subject("evicted", "acme"), _evicted(1, "acme"))
    assert await follower.wait(lambda: len(got) == 2, 10.0)
    assert [e.idx for e in got] == [0, 1]
    await follower.stop()
