"""A run's lifecycle as its orchestrator sees it: admission by the registry, then eviction.

:class:`RunWatch` replays stream ``PLEXRL_RUNS`` from its first message with a
:class:`~services.bus.Follower` and keeps every lifecycle event about one run id, then
follows the stream for as long as the orchestrator lives. The replay is what lets a restarted
orchestrator tell "never heard of" from "discovered long ago" from "evicted yesterday".

:func:`admit` gets the run accepted:

1. it reads the run's :class:`~schemas.records.RunRecord` in KV ``plexrl-registry``;
2. an evicted run stays evicted (:class:`RunRemoved`); a run the registry holds (active or
   waiting) with another config is refused (:class:`RunRejected`): the registry would keep its
   own config and the orchestrator would train something else than it was told;
3. a run the registry does not hold (no record, forgotten, invalid) is submitted with
   ``RunSubmitted``;
4. it waits until the newest lifecycle event about the run is a ``RunDiscovered`` with this
   config. A ``RunConfigInvalid`` (or a registry ``ServiceError`` about the run) published after
   the submit is a rejection; a ``RunEvicted`` a removal.

An *incarnation* is one life of a run id: it starts with the first RunDiscovered after the run
id's last eviction or disappearance. Its stream sequence and time tell this life's weights,
batches and checkpoint from those a deleted and recreated run of the same id left behind.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from nats.aio.msg import Msg

from schemas import subjects as sj
from schemas.codec import DecodeError, decode
from schemas.config import OrchConfig
from schemas.events import (
    RunConfigInvalid,
    RunDiscovered,
    RunEvicted,
    RunForgotten,
    RunSubmitted,
    ServiceError,
)
from schemas.records import HOLDING_STATUSES
from services.bus import Bus, Follower, MessageMeta
from services.runs.table import read_record

log = logging.getLogger(__name__)

Lifecycle = RunDiscovered | RunConfigInvalid | RunEvicted | RunForgotten
_SUBJECTS = frozenset({sj.DISCOVERED, sj.INVALID, sj.EVICTED, sj.FORGOTTEN})


class RunRejected(Exception):
    """The registry will not run this run with this config (exit status 2)."""


class RunRemoved(Exception):
    """The run was evicted or forgotten (exit status 3); ``reason`` says why."""

    def __init__(self, run_id: str, reason: str) -> None:
        super().__init__(f"{run_id} evicted: {reason}")
        self.run_id = run_id
        self.reason = reason


def removal_reason(event: RunEvicted | RunForgotten) -> str:
    if isinstance(event, RunEvicted):
        return event.reason
    return "its run directory was removed (RunForgotten)"


@dataclass(frozen=True)
class LifecycleEntry:
    """One lifecycle event about the run, with where and when the stream stored it."""

    seq: int
    time: datetime
    event: Lifecycle


@dataclass(frozen=True)
class Admission:
    """The run is discovered: its index and where this incarnation of it started."""

    idx: int
    incarnation_seq: int
    incarnation_time: datetime


class RunWatch:
    """Every lifecycle event about ``run_id`` on PLEXRL_RUNS, replayed and then followed."""

    def __init__(self, bus: Bus, run_id: str) -> None:
        self.bus = bus
        self.run_id = run_id
        self.entries: list[LifecycleEntry] = []
        # The whole runs wildcard rather than the four lifecycle subjects: then the stream's
        # last sequence is one this follower is sure to reach.
        self._follower: Follower[Lifecycle] = Follower(
            bus,
            sj.RUNS_STREAM,
            sj.RUNS_WILDCARD,
            Lifecycle,
            self._on_event,
            decode_subjects=_SUBJECTS,
        )

    @property
    def seen_seq(self) -> int:
        return self._follower.seq

    async def start(self, timeout: float = 30.0) -> None:
        """Subscribe and wait until everything the stream held at this call has been seen."""
        await self._follower.start()
        try:
            await self._follower.wait_until_caught_up(timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"replaying {sj.RUNS_STREAM}: {exc}") from None

    async def stop(self) -> None:
        await self._follower.stop()

    def _on_event(self, seq: int, event: Lifecycle, meta: MessageMeta) -> None:
        if event.run_id == self.run_id:
            self.entries.append(LifecycleEntry(seq, meta.time, event))

    async def wait(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Wait until ``predicate()`` holds (re-checked after each message); False on timeout."""
        return await self._follower.wait(predicate, timeout)

    async def wait_past(self, seq: int, timeout: float) -> bool:
        """Wait until a message after stream sequence ``seq`` arrives; False on timeout."""
        return await self.wait(lambda: self.seen_seq > seq, timeout)

    def latest(self) -> LifecycleEntry | None:
        return self.entries[-1] if self.entries else None

    def after(self, seq: int) -> list[LifecycleEntry]:
        return [e for e in self.entries if e.seq > seq]

    def removal_after(self, seq: int) -> LifecycleEntry | None:
        """The first eviction or disappearance of the run stored after ``seq``, if any."""
        for entry in self.after(seq):
            if isinstance(entry.event, RunEvicted | RunForgotten):
                return entry
        return None

    def incarnation_start(self) -> LifecycleEntry | None:
        """The first RunDiscovered after the run id's last removal (None if none yet)."""
        start: LifecycleEntry | None = None
        for entry in self.entries:
            if isinstance(entry.event, RunEvicted | RunForgotten):
                start = None
            elif isinstance(entry.event, RunDiscovered) and start is None:
                start = entry
        return start


async def admit(
    bus: Bus,
    watch: RunWatch,
    config: OrchConfig,
    *,
    submitted_by: str,
    stop: asyncio.Event,
    registry_service: str = "registry",
    report_every: float = 10.0,
) -> Admission | None:
    """Submit the run if the registry does not hold it, then wait for its RunDiscovered.

    Returns None if ``stop`` is set first. See the module docstring for the rules.
    """
    run_id, digest = watch.run_id, config.digest()
    record = await read_record(bus, run_id)
    status = record.status if record else None
    if record is not None and record.status == "evicted":
        raise RunRemoved(run_id, record.reason or "evicted earlier")
    held_digest = record.config_digest if record else ""
    if status in HOLDING_STATUSES and held_digest and held_digest != digest:
        raise RunRejected(
            f"{run_id} already exists with a different config (registry: {held_digest}, "
            f"given: {digest}); evict it or choose another run id"
        )

    mark = watch.seen_seq
    errors: list[ServiceError] = []

    async def on_error(msg: Msg) -> None:
        try:
            err: ServiceError = decode(
                msg.data, ServiceError, (msg.headers or {}).get("Content-Type")
            )
        except DecodeError:
            return  # an InvalidMessage or something else that is not about us
        if err.run_id == run_id and err.service == registry_service:
            errors.append(err)

    error_sub = await bus.nc.subscribe(sj.errors_subject(registry_service), cb=on_error)
    try:
        if status not in HOLDING_STATUSES:
            event = RunSubmitted(run_id=run_id, config=config.to_dict(), submitted_by=submitted_by)
            await bus.publish(sj.SUBMIT, event, msg_id=f"{run_id}/submit/{uuid.uuid4().hex}")
            log.info("%s: submitted to the registry (config %s)", run_id, digest)
        next_report = time.monotonic() + report_every
        while not stop.is_set():
            for entry in watch.after(mark):
                match entry.event:
                    case RunConfigInvalid(error=error):
                        raise RunRejected(f"the registry rejected {run_id}: {error}")
                    case RunEvicted() as evicted:
                        raise RunRemoved(run_id, removal_reason(evicted))
            latest = watch.latest()
            if (
                latest is not None
                and isinstance(latest.event, RunDiscovered)
                and latest.event.config_digest in ("", digest)
            ):
                start = watch.incarnation_start() or latest
                return Admission(latest.event.idx, start.seq, start.time)
            if errors:
                raise RunRejected(f"the registry refused {run_id}: {errors[0].error}")
            if time.monotonic() >= next_report:
                now = await read_record(bus, run_id)
                log.info(
                    "%s: waiting to be discovered (registry status: %s)",
                    run_id,
                    now.status if now else "no record; is a registry running?",
                )
                next_report = time.monotonic() + report_every
            await watch.wait_past(watch.seen_seq, timeout=0.25)
        return None
    finally:
        try:
            await error_sub.unsubscribe()
        except Exception as exc:  # the connection may be closing under us
            log.debug("admit: unsubscribe failed: %s", exc)
