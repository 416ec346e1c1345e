"""A tenant's follower reads the view the services keep in its own account, across a restart.

The server runs the accounts of ``plexrl nats-config`` for the services and tenant ``acme``.
The services keep acme's view (``PLEXRL_RUNS`` in acme's account, :mod:`services.tenants.views`)
and publish acme's lifecycle events in their own account; acme's follower, with nothing but
acme's seed, replays and follows them through the plain ordered consumer every client uses, and
keeps following after the server restarts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from accounts_support import AccountsBroker, accounts_broker

from schemas import RunEvicted
from schemas import subjects as sj
from services.bus import Bus, Follower, MessageMeta
from services.config.tenants import TenantQuota
from services.tenants.credentials import SERVICES
from services.tenants.views import ensure_views

ACME = "acme"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[AccountsBroker]:
    with accounts_broker(tmp_path, {ACME: TenantQuota()}) as b:
        yield b


@pytest.fixture
async def buses(broker: AccountsBroker) -> AsyncIterator[tuple[Bus, Bus]]:
    services = await broker.connect(SERVICES)
    assert await ensure_views(services.nc, ACME)  # created now: something changed
    acme = await broker.connect(ACME)
    yield services, acme
    await acme.close()
    await services.close()


def evicted(k: int) -> RunEvicted:
    return RunEvicted(run_id=f"run_{k}", idx=0, reason=f"r{k}", tenant=ACME)


async def test_a_tenant_follows_its_view_and_keeps_following_across_a_server_restart(
    broker: AccountsBroker, buses: tuple[Bus, Bus]
) -> None:
    services, acme = buses
    subject = sj.runs_subject("evicted", ACME)
    for k in range(3):
        await services.publish(subject, evicted(k), msg_id=f"run_{k}/evicted/1")
    seen: list[tuple[str, str]] = []

    def on_event(seq: int, event: RunEvicted, meta: MessageMeta) -> None:
        seen.append((event.run_id, meta.subject))

    follower: Follower[RunEvicted] = Follower(
        acme, sj.RUNS_STREAM, f"plexrl.runs.{ACME}.>", RunEvicted, on_event, heartbeat=0.5
    )
    await follower.start()
    await follower.wait_until_caught_up(timeout=30)
    assert seen == [(f"run_{k}", subject) for k in range(3)]  # replayed from acme's own view
    broker.server.stop()
    broker.server.start()
    for k in range(3, 6):
        await services.publish(subject, evicted(k), msg_id=f"run_{k}/evicted/1")
    await follower.wait(lambda: len(seen) == 6, timeout=60)
    assert [r for r, _ in seen] == [f"run_{k}" for k in range(6)]
    assert await acme.js.get_last_msg(sj.RUNS_STREAM, subject) is not None
    await follower.stop()


async def test_a_tenant_cannot_see_the_services_streams_and_the_views_come_back(
    buses: tuple[Bus, Bus],
) -> None:
    services, acme = buses
    names = {info.config.name for info in await acme.js.streams_info()}
    assert names == {sj.RUNS_STREAM, sj.WEIGHTS_STREAM}
    runs = await acme.js.stream_info(sj.RUNS_STREAM)
    assert set(runs.config.subjects or []) == {sj.runs_subject(k, ACME) for k in sj.LIFECYCLE_KINDS}
    # a tenant may delete its own views: it only hurts itself, and the services restore them
    await acme.js.delete_stream(sj.RUNS_STREAM)
    assert await ensure_views(services.nc, ACME) == [f"tenant {ACME}: created stream PLEXRL_RUNS"]
    assert await ensure_views(services.nc, ACME) == []  # and then nothing is left to do
