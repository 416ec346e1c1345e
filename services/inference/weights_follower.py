"""Follows ``PLEXRL_WEIGHTS`` so that every replica loads every run's newest adapter.

Replicas do not share this work: each one needs every adapter. So each follows the stream with
its own :class:`~services.bus.Follower` (an ordered consumer: ephemeral, unacknowledged,
flow-controlled), starting from the last message of every subject: a fresh replica catches up on
each run's newest WeightsReady at once and then follows new ones.

A run of tenant ``t`` is announced on ``plexrl.weights.<t>.<run_id>`` and its adapter is read
from ``t``'s object store. An announcement whose subject's tenant is not the run's
(``tenant_of``) is refused and reported as InvalidMessage; while the run is unknown, ``wanted``
gets the subject's tenant to hold it under.

Per run, the newest announcement waiting wins: while one adapter loads, later ones of the same
run replace each other, so a replica that falls behind skips versions instead of replaying them.
Runs load in parallel, each in its own task.

A load that fails (an unreadable or garbage-collected blob, a digest mismatch, tensors that do
not fit) is tried ``attempts`` times in all, then reported once on ``plexrl.errors.<service>``
and given up: the run keeps serving the version it had, and the next announcement of that run
starts afresh. There is nothing to ack or term on an ordered consumer; giving up is final.

Full weights (``kind == "full"``) are not loaded into fresh tensors: ``install_full`` gets the
event and a loader bound to it, and hands that loader the tensors to receive the bytes into
(the engine's own parameters). When a failed attempt may have written part of them
(``WeightsError.touched``), the report says that the run is not served until a good version
loads, rather than that its previous version stays in service.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode
from torch import Tensor

from schemas import subjects as sj
from schemas.codec import DecodeError, encode
from schemas.events import WeightsReady
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus, Follower, MessageMeta, tracing
from services.inference.jobs import LoadInto
from services.weights.loader import WeightsError, load_weights
from services.weights.transport import WeightFetcher

log = logging.getLogger(__name__)

Install = Callable[[WeightsReady, dict[str, Any]], Awaitable[None]]
Wanted = Callable[[WeightsReady, dict[str, str], str], bool]
"""``wanted(event, headers, tenant)``: load it? ``tenant`` is the one its subject names."""
InstallFull = Callable[[WeightsReady, LoadInto], Awaitable[None]]


class WeightsFollower:
    """Loads each announced adapter that ``wanted(event, headers, tenant)`` accepts, hands it to
    ``install``.

    ``wanted`` decides without I/O (is the run known here, is the version newer); ``install``
    may raise ValueError for tensors that do not fit, which counts as a failed attempt.
    ``install_full`` installs full weights through the loader it is given (see the module
    docstring); without it they are refused as a failed attempt. ``fetchers`` receive the
    direct transports they name (a collective group joined at start-up); see
    :func:`~services.weights.loader.load_weights`. ``tenant_of(run_id)`` is the tenant of a
    run this replica knows, None otherwise.
    """

    def __init__(
        self,
        bus: Bus,
        *,
        wanted: Wanted,
        install: Install,
        install_full: InstallFull | None = None,
        output_dir: Path | None = None,
        attempts: int = 2,
        retry_delay: float = 0.2,
        fetchers: Mapping[str, WeightFetcher] | None = None,
        tenant_of: Callable[[str], str | None] = lambda run_id: None,
    ) -> None:
        self.bus = bus
        self.tenant_of = tenant_of
        self.fetchers = dict(fetchers or {})
        self.wanted = wanted
        self.install = install
        self.install_full = install_full
        self.output_dir = output_dir
        self.attempts = attempts
        self.retry_delay = retry_delay
        self.tries: Counter[tuple[str, int]] = Counter()
        """Load attempts per (run_id, step), for metrics and tests."""
        self.failed: Counter[str] = Counter()
        """Adapters given up per run."""
        self.num_wrong_tenant = 0
        """Announcements refused because their subject's tenant is not the run's."""
        self.received_at: dict[tuple[str, int], float] = {}
        """``time.monotonic()`` at which each (run_id, step) announcement arrived."""
        self.published_at: dict[tuple[str, int], float] = {}
        """``time.monotonic()`` at which the stream stored each announcement (its publish)."""
        self._mailbox: dict[str, tuple[WeightsReady, dict[str, str], str]] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._follower = Follower(
            bus,
            sj.WEIGHTS_STREAM,
            sj.WEIGHTS_WILDCARD,
            WeightsReady,
            self._on_event,
            start="last_per_subject",
        )
        self._tracer = tracing.tracer(f"plexrl.{bus.service}")

    async def start(self) -> None:
        await self._follower.start()

    async def stop(self) -> None:
        await self._follower.stop()
        workers = list(self._workers.values())
        for task in workers:
            task.cancel()
        await asyncio.gather(*workers, return_exceptions=True)

    def _on_event(self, seq: int, event: WeightsReady, meta: MessageMeta) -> None:
        # The follower reports a DecodeError as invalid and skips the message.
        try:
            tenant, run_id = sj.per_run_subject(meta.subject)
        except ValueError as exc:
            raise DecodeError(f"a WeightsReady arrived on {meta.subject}: {exc}") from None
        if run_id != event.run_id:
            raise DecodeError(f"a WeightsReady for {event.run_id} arrived on {meta.subject}")
        wrong = self._wrong_tenant(event, tenant)
        if wrong is not None:
            self.num_wrong_tenant += 1
            raise DecodeError(wrong)
        if len(self.received_at) >= 4096:  # a bounded record: forget the oldest half
            for key in list(self.received_at)[:2048]:
                del self.received_at[key]
                self.published_at.pop(key, None)
        self.received_at[(event.run_id, event.step)] = now = time.monotonic()
        # When the stream stored the announcement, on this process's monotonic clock (the
        # server's wall clock and ours are the same machine's, or NTP-close).
        age = time.time() - meta.time.timestamp()
        self.published_at[(event.run_id, event.step)] = now - max(0.0, age)
        self.submit(event, dict(meta.headers), tenant)

    def _wrong_tenant(self, event: WeightsReady, tenant: str) -> str | None:
        """Why an announcement of ``tenant`` for ``event.run_id`` is refused, or None."""
        owner = self.tenant_of(event.run_id)
        if owner is None or owner == tenant:
            return None
        return (
            f"tenant {tenant!r} announced weights (step {event.step}) of {event.run_id}, which "
            f"belongs to tenant {owner!r}: refused"
        )

    async def refuse(self, event: WeightsReady, tenant: str) -> None:
        """Report an announcement by ``tenant`` of another tenant's run, and count it."""
        self.num_wrong_tenant += 1
        owner = self.tenant_of(event.run_id)
        why = self._wrong_tenant(event, tenant) or (
            f"tenant {tenant!r} announced weights (step {event.step}) of {event.run_id}, which "
            f"belongs to tenant {owner!r}: refused"
        )
        log.warning("%s", why)
        subject = sj.tenant_weights_subject(event.run_id, tenant)
        await self.bus.report_invalid(subject, why, encode(event))

    def submit(
        self,
        event: WeightsReady,
        headers: dict[str, str] | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> None:
        """Queue ``event``, announced on ``tenant``'s subject, for loading (also used to replay
        one held back for an unknown run)."""
        waiting = self._mailbox.get(event.run_id)
        if waiting is None or waiting[0].step < event.step:
            self._mailbox[event.run_id] = (event, dict(headers or {}), tenant)
        if event.run_id not in self._workers:
            self._workers[event.run_id] = asyncio.create_task(
                self._drain(event.run_id), name=f"weights-{event.run_id}"
            )

    async def idle(self) -> None:
        """Wait until no adapter is waiting or loading (for tests and benchmarks)."""
        while self._workers:
            await asyncio.gather(*list(self._workers.values()), return_exceptions=True)

    async def _drain(self, run_id: str) -> None:
        try:
            while run_id in self._mailbox:
                event, headers, tenant = self._mailbox.pop(run_id)
                if self._wrong_tenant(event, tenant) is not None:
                    await self.refuse(event, tenant)  # held while the run was unknown
                elif self.wanted(event, headers, tenant):
                    await self._load(event, headers, tenant)
        finally:
            del self._workers[run_id]

    async def _load(self, event: WeightsReady, headers: dict[str, str], tenant: str) -> None:
        with self._tracer.start_as_current_span(
            "weights load",
            context=tracing.extract(headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "run_id": event.run_id,
                "idx": event.idx,
                "policy_version": event.step,
                "transport": event.transport,
                "size_bytes": event.size_bytes,
            },
        ) as span:
            error, touched = "", False
            for attempt in range(1, self.attempts + 1):
                self.tries[(event.run_id, event.step)] += 1
                try:
                    if event.is_full:
                        await self._install_full(event, tenant)
                    else:
                        tensors = await load_weights(
                            self.bus, event, self.output_dir, fetchers=self.fetchers, tenant=tenant
                        )
                        await self.install(event, tensors)
                    return
                except (WeightsError, ValueError) as exc:
                    error = str(exc)
                    # Once written into, the parameters stay suspect until a load succeeds.
                    touched = touched or (isinstance(exc, WeightsError) and exc.touched)
                    log.warning("%s (attempt %d of %d)", error, attempt, self.attempts)
                if attempt < self.attempts:
                    await asyncio.sleep(self.retry_delay)
            self.failed[event.run_id] += 1
            span.set_status(Status(StatusCode.ERROR, error))
            what = "full weights" if event.is_full else "adapter"
            if touched:
                outcome = (
                    f"part of them was already written in place, so {event.run_id} is not "
                    "served until a good version loads"
                )
            else:
                outcome = "the previous version stays in service"
            await self.bus.report_error(
                f"{what} of {event.run_id} at step {event.step} rejected after "
                f"{self.attempts} attempts, {outcome}: {error}",
                run_id=event.run_id,
                step=event.step,
                transport=event.transport,
                location=event.location,
                kind="full" if event.is_full else "lora",
                touched=touched,
            )

    async def load(self, event: WeightsReady, tenant: str) -> dict[str, Any]:
        """The adapter tensors ``event`` (announced by ``tenant``) names, fetched and checked
        against its digest (for a snapshot of an older version: services/inference/exact.py)."""
        return await load_weights(
            self.bus, event, self.output_dir, fetchers=self.fetchers, tenant=tenant
        )

    async def _install_full(self, event: WeightsReady, tenant: str) -> None:
        if self.install_full is None:
            raise ValueError(
                f"full weights of {event.run_id} at step {event.step}: this replica does not "
                "install full model weights"
            )

        async def load(destination: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
            return await load_weights(
                self.bus,
                event,
                self.output_dir,
                fetchers=self.fetchers,
                destination=destination,
                tenant=tenant,
            )

        await self.install_full(event, load)
