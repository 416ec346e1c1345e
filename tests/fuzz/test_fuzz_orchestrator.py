"""Fuzzing an orchestrator's decoders: the lifecycle events its RunWatch follows and the
WeightsReady announcements of its run that PolicyVersions follows, on the orchestrator's own
connection. Every bad payload is skipped and reported as InvalidMessage on
``plexrl.errors.orchestrator``; the events published after them are seen; neither follower
stalls."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import subjects as sj
from schemas.events import (
    LoraSpec,
    RunConfigInvalid,
    RunDiscovered,
    RunEvicted,
    RunForgotten,
    WeightsReady,
)
from services.bus import Bus, EmbeddedNats
from services.orchestrator.lifecycle import RunWatch
from services.orchestrator.versions import PolicyVersions

from .fuzz_payloads import Wire, decodes, fuzz, wires
from .fuzz_support import Reports, eventually, publish

RUN = "run_orch"


def _weights(step: int) -> WeightsReady:
    return WeightsReady(
        run_id=RUN,
        idx=0,
        step=step,
        transport="object_store",
        location=f"{RUN}/step_{step}",
        digest="blake3:" + "0" * 64,
        size_bytes=10,
        lora=LoraSpec(rank=2, alpha=4.0, target_modules=["q_proj"]),
    )


Lifecycle = RunDiscovered | RunConfigInvalid | RunEvicted | RunForgotten
_LIFECYCLE = st.sampled_from([sj.DISCOVERED, sj.INVALID, sj.EVICTED, sj.FORGOTTEN])

# Only payloads that are no event: a valid lifecycle event or announcement is the registry's or
# the trainer's word about the run, which the orchestrator follows.
THROWN = st.one_of(
    wires(_LIFECYCLE, RunDiscovered(run_id=RUN, idx=0, config={})),
    wires(_LIFECYCLE, RunConfigInvalid(run_id=RUN, error="x")),
    wires(_LIFECYCLE, RunEvicted(run_id=RUN, idx=0, reason="x")),
    wires(_LIFECYCLE, RunForgotten(run_id=RUN, idx=0)),
    wires(st.just(sj.weights_subject(RUN)), _weights(1)),
).filter(lambda w: decodes(w, WeightsReady if ".weights." in w.subject else Lifecycle) is None)


@dataclass
class Followers:
    bus: Bus
    watch: RunWatch
    versions: PolicyVersions
    reports: Reports
    rounds: itertools.count[int]


@pytest.fixture
async def followers(server: EmbeddedNats, fbus: Bus) -> AsyncIterator[Followers]:
    bus = await Bus.connect(server.url, "orchestrator")
    watch = RunWatch(bus, RUN)
    versions = PolicyVersions(bus, RUN)
    await watch.start()
    await versions.start()
    reports = await Reports(fbus, "orchestrator").start()
    yield Followers(fbus, watch, versions, reports, itertools.count(1))
    await reports.stop()
    await versions.stop()
    await watch.stop()
    await bus.close()


@fuzz(25)
@given(batch=st.lists(THROWN, min_size=1, max_size=6))
async def test_bad_lifecycle_events_and_announcements_are_skipped_and_reported(
    followers: Followers, batch: list[Wire]
) -> None:
    f = followers
    since = f.reports.mark()
    for wire in batch:
        await publish(f.bus, wire)
    n = next(f.rounds)
    seq = await f.bus.publish(sj.FORGOTTEN, RunForgotten(run_id=RUN, idx=n))
    await f.bus.publish(sj.weights_subject(RUN), _weights(n))

    await eventually(
        lambda: _seen(f.watch, seq.seq), f"RunForgotten #{seq.seq} in the orchestrator's RunWatch"
    )
    await eventually(lambda: _version(f.versions, n), f"policy version {n} announced")
    await f.reports.expect(since, batch)


async def _seen(watch: RunWatch, seq: int) -> bool:
    latest = watch.latest()
    return latest is not None and latest.seq == seq


async def _version(versions: PolicyVersions, n: int) -> bool:
    return versions.latest == n
