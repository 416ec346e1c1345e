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

**Tenants.** The orchestrator acts for one tenant (:func:`acting_tenant`: ``PLEXRL_TENANT``,
default ``default``). The default tenant's orchestrator works exactly as above. A tenant's
credentials reach only its own subjects (``plexrl.runs.<tenant>.*``...) and none of the KV
buckets, so a tenant's orchestrator follows ``plexrl.runs.<tenant>.>`` only (with accounts: in
the view its own account keeps), submits on ``plexrl.runs.<tenant>.submit`` (with accounts the
registry answers the submit itself, and a refusal comes back as the publish's error), and learns
what step 1 reads from the record through the registry's list service
(``plexrl.registry.<tenant>.list``, :func:`registry_row`) and from the lifecycle events it
follows. A lifecycle event whose ``tenant`` is not the one its subject names
is ignored (the broker vouches for the subject, not for the body).

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
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError

from schemas import subjects as sj
from schemas.codec import DecodeError, decode
from schemas.config import OrchConfig
from schemas.events import (
    RunConfigInvalid,
    RunDiscovered,
    RunEvicted,
    RunForgotten,
    RunRow,
    RunSubmitted,
    ServiceError,
)
from schemas.records import HOLDING_STATUSES
from schemas.tenant import DEFAULT_TENANT, validate_tenant
from services.bus import Bus, Follower, MessageMeta
from services.config import process_settings
from services.runs.table import RunListFailed, list_runs, read_record

log = logging.getLogger(__name__)

Lifecycle = RunDiscovered | RunConfigInvalid | RunEvicted | RunForgotten
_SUBJECTS = frozenset({sj.DISCOVERED, sj.INVALID, sj.EVICTED, sj.FORGOTTEN})


def acting_tenant(tenant: str | None = None) -> str:
    """``tenant`` if given, else the tenant this process acts for (``PLEXRL_TENANT``)."""
    return process_settings().tenant if tenant is None else validate_tenant(tenant)


def _runs_filter(tenant: str) -> str:
    """What a tenant's RunWatch follows: every runs subject it may read."""
    if tenant == DEFAULT_TENANT:
        return sj.RUNS_WILDCARD
    return sj.runs_subject("discovered", tenant).rpartition(".")[0] + ".>"


class RegistryListError(RuntimeError):
    """The registry's list service did not answer, or answered with an error."""


async def registry_row(
    bus: Bus, run_id: str, tenant: str, *, timeout: float = 5.0
) -> RunRow | None:
    """``run_id``'s row in the registry's list for ``tenant``, None if the registry lists none.

    Raises :class:`RegistryListError` when no registry answers within ``timeout`` or the reply
    carries an error. A row that names another tenant is no row of this tenant's.
    """
    subject = sj.registry_list_subject(tenant)
    try:
        rows = await list_runs(bus, tenant, timeout=timeout)
    except NoRespondersError:
        raise RegistryListError(f"no registry answers on {subject}") from None
    except NatsTimeout:
        raise RegistryListError(f"no reply on {subject} within {timeout:g}s") from None
    except RunListFailed as exc:
        raise RegistryListError(f"{subject}: {exc}") from None
    return next((r for r in rows if r.run_id == run_id and r.tenant == tenant), None)


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
    """Every lifecycle event about ``run_id`` on PLEXRL_RUNS, replayed and then followed.

    ``tenant`` (default: :func:`acting_tenant`) picks the subjects: the default tenant's
    lifecycle subjects, or ``plexrl.runs.<tenant>.*``.
    """

    def __init__(self, bus: Bus, run_id: str, *, tenant: str | None = None) -> None:
        self.bus = bus
        self.run_id = run_id
        self.tenant = acting_tenant(tenant)
        self.entries: list[LifecycleEntry] = []
        subjects = (
            _SUBJECTS
            if self.tenant == DEFAULT_TENANT
            else frozenset(sj.runs_subject(kind, self.tenant) for kind in sj.LIFECYCLE_KINDS)
        )
        # Every runs subject the tenant may read rather than the four lifecycle subjects: then
        # the last sequence on the filter is one this follower is sure to reach.
        self._follower: Follower[Lifecycle] = Follower(
            bus,
            sj.RUNS_STREAM,
            _runs_filter(self.tenant),
            Lifecycle,
            self._on_event,
            decode_subjects=subjects,
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
        if event.run_id != self.run_id:
            return
        if event.tenant != self.tenant:
            log.warning(
                "%s: ignoring %s #%d on %s: it names tenant %r, the subject %r",
                self.run_id,
                type(event).__name__,
                seq,
                meta.subject,
                event.tenant,
                self.tenant,
            )
            return
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


@dataclass(frozen=True)
class _Held:
    """What the registry holds about the run before it is submitted (status None: nothing)."""

    status: str | None
    config_digest: str = ""
    reason: str = ""


async def _held(bus: Bus, watch: RunWatch) -> _Held:
    if watch.tenant == DEFAULT_TENANT:
        record = await read_record(bus, watch.run_id)
        if record is None:
            return _Held(None)
        return _Held(record.status, record.config_digest, record.reason)
    # A tenant cannot read the table: the registry's list says the status and the config's
    # digest, the lifecycle events the reason of an eviction (and the digest, from a
    # RunDiscovered, where the list is older than RunRow.config_digest or does not answer).
    latest = watch.latest()
    event = latest.event if latest is not None else None
    digest = event.config_digest if isinstance(event, RunDiscovered) else ""
    reason = removal_reason(event) if isinstance(event, RunEvicted | RunForgotten) else ""
    try:
        row = await registry_row(bus, watch.run_id, watch.tenant)
    except RegistryListError as exc:
        log.warning("%s: %s; going by the lifecycle events alone", watch.run_id, exc)
        return _Held(_status_of(event), digest, reason)
    if row is None:
        return _Held(None)
    held = row.config_digest or (digest if row.status == "active" else "")
    return _Held(row.status, held, row.detail or reason)


def _status_of(event: Lifecycle | None) -> str | None:
    match event:
        case RunDiscovered():
            return "active"
        case RunConfigInvalid():
            return "invalid"
        case RunEvicted():
            return "evicted"
        case RunForgotten():
            return "forgotten"
    return None


async def _status_now(bus: Bus, watch: RunWatch) -> str:
    """The registry's status of the run, for the log while admission waits."""
    if watch.tenant == DEFAULT_TENANT:
        record = await read_record(bus, watch.run_id)
        return record.status if record else "no record; is a registry running?"
    try:
        row = await registry_row(bus, watch.run_id, watch.tenant)
    except RegistryListError as exc:
        return f"unknown: {exc}"
    return row.status if row else "not listed yet"


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
    run_id, digest, tenant = watch.run_id, config.digest(), watch.tenant
    held = await _held(bus, watch)
    status = held.status
    if status == "evicted":
        raise RunRemoved(run_id, held.reason or "evicted earlier")
    if status in HOLDING_STATUSES and held.config_digest and held.config_digest != digest:
        raise RunRejected(
            f"{run_id} already exists with a different config (registry: {held.config_digest}, "
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

    # A tenant may not read the registry's error reports; what the registry refuses of a
    # tenant's it answers with a RunConfigInvalid on the tenant's own subject.
    error_sub = None
    if tenant == DEFAULT_TENANT:
        error_sub = await bus.nc.subscribe(sj.errors_subject(registry_service), cb=on_error)
    try:
        if status not in HOLDING_STATUSES:
            event = RunSubmitted(run_id=run_id, config=config.to_dict(), submitted_by=submitted_by)
            try:
                await bus.publish(
                    sj.runs_subject("submit", tenant),
                    event,
                    msg_id=f"{run_id}/submit/{uuid.uuid4().hex}",
                )
            except APIError as exc:  # with accounts the registry answers a tenant's submit
                raise RunRejected(f"the registry refused {run_id}: {exc.description}") from None
            log.info("%s: submitted to the registry (config %s)", run_id, digest)
        next_report = time.monotonic() + report_every
        while not stop.is_set():
            for entry in watch.after(mark):
                match entry.event:
                    case RunConfigInvalid(error=error):
                        raise RunRejected(f"the registry rejected {run_id}: {error}")
                    case RunEvicted() as evicted:
                        raise RunRemoved(run_id, removal_reason(evicted))
                    case RunDiscovered(config_digest=other) if other and other != digest:
                        raise RunRejected(
                            f"{run_id} was discovered with another config (registry: {other}, "
                            f"given: {digest}); evict it or choose another run id"
                        )
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
                log.info(
                    "%s: waiting to be discovered (registry status: %s)",
                    run_id,
                    await _status_now(bus, watch),
                )
                next_report = time.monotonic() + report_every
            await watch.wait_past(watch.seen_seq, timeout=0.25)
        return None
    finally:
        try:
            if error_sub is not None:
                await error_sub.unsubscribe()
        except Exception as exc:  # the connection may be closing under us
            log.debug("admit: unsubscribe failed: %s", exc)
