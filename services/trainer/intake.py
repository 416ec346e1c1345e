"""The rollout intake: rank 0's consumer of PLEXRL_ROLLOUTS, holding batches until their turn.

A durable pull consumer (``plexrl.rollouts.>``) feeds batches into a table of pending batches per
run and step. At each step boundary the service asks :meth:`Intake.select` which batches are
trainable, given each run's next expected step and the steps its latest checkpoint holds:

==========================  ==================================================================
batch step ``s``            what happens
==========================  ==================================================================
``s < committed``           in a checkpoint already (a redelivery): ack, skip
``committed <= s < next``   trained since the last checkpoint: handed back to the service,
                            which acks it once a checkpoint holds the step
``s == next``               trainable now
``s > next``                held until its turn (kept alive with in-progress signals)
==========================  ==================================================================

so no step is ever trained twice, whatever the server redelivers. Batches of a run the trainer
does not hold: dropped (acked) when the run was evicted or forgotten, according to this
trainer's own deletion hooks or the registry's table (KV ``plexrl-registry``); otherwise held
for ``unknown_run_hold`` seconds, as the run's RunDiscovered may still be on its way, then
handed back to the server (nak with a delay). A run the trainer is evicting has its batches
acked and dropped. Two messages for one run and step (a republish outside the deduplication
window) keep the first; the second is acked.

Tenants: a batch of a default-tenant run comes on ``plexrl.rollouts.<run_id>``, one of tenant
``t``'s runs on ``plexrl.rollouts.<t>.<run_id>``; the broker lets ``t`` publish only there. A
batch whose subject's tenant is not the run's (``tenant_of``, the run mirror) is terminated,
reported as InvalidMessage naming the sending tenant and the run, and counted; the run it names
is not touched. While the run is not known yet, batches of one step sent by different tenants
are all held, and sorted out once its tenant is known.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from schemas.events import RolloutBatch
from schemas.records import GONE_STATUSES, RunStatus
from schemas.subjects import per_run_subject
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus, Consumer, Delivery
from services.runs.table import read_record

log = logging.getLogger(__name__)

FETCH_TIMEOUT = 0.25
"""seconds one fetch waits for batches (and how long its pull request lingers on the server)"""

Place = Literal["done", "uncommitted", "train", "wait"]


def place(step: int, next_step: int, committed_step: int) -> Place:
    """Where a batch of ``step`` stands for a run expecting ``next_step`` (see the table)."""
    if step < committed_step:
        return "done"
    if step < next_step:
        return "uncommitted"
    if step == next_step:
        return "train"
    return "wait"


@dataclass(frozen=True)
class RunSteps:
    """Where a run the trainer holds stands: what the intake needs to place its batches."""

    next_step: int
    committed_step: int
    evicting: bool = False


@dataclass
class Held:
    """A batch the intake holds, with the delivery that acks it."""

    batch: RolloutBatch
    delivery: Delivery
    first_seen: float = field(default_factory=time.monotonic)
    tenant: str = DEFAULT_TENANT
    """the tenant whose subject the batch came on (the broker vouches for it)"""
    rivals: list[Held] = field(default_factory=list)
    """batches of the same run and step from other tenants, while the run's tenant is unknown"""

    def all(self) -> Iterator[Held]:
        yield self
        yield from self.rivals


@dataclass
class Selection:
    train: dict[str, Held] = field(default_factory=dict)
    """run id -> its next batch, trainable now"""
    uncommitted: list[Held] = field(default_factory=list)
    """redeliveries of steps trained but not yet checkpointed"""


class Intake:
    """Pending batches per run and step, fed by a durable consumer."""

    def __init__(
        self,
        bus: Bus,
        consumer: Consumer[RolloutBatch],
        *,
        unknown_run_hold: float = 5.0,
        tenant_of: Callable[[str], str | None] = lambda run_id: None,
    ) -> None:
        self.bus = bus
        self.tenant_of = tenant_of
        """the tenant of a run the trainer holds, None for a run it does not know (yet)"""
        self.consumer = consumer
        self.unknown_run_hold = unknown_run_hold
        self.pending: dict[str, dict[int, Held]] = {}
        self.removed: set[str] = set()
        """runs whose deletion hook ran in this trainer's lifetime (and were not re-created)"""
        self.arrived = asyncio.Event()
        self.num_skipped = 0
        """redelivered batches of checkpointed steps, acked and skipped"""
        self.num_dropped = 0
        """batches of evicted or forgotten runs, acked and dropped"""
        self.num_wrong_tenant = 0
        """batches sent on another tenant's subject than their run's, terminated and reported"""
        self._status_cache: dict[str, tuple[float, RunStatus | None]] = {}

    # --- feeding -------------------------------------------------------------------------------

    async def pump(self, stop: asyncio.Event) -> None:
        """Fetch batches into the table until ``stop`` is set."""
        await self.consumer.start()
        while not stop.is_set():
            try:
                got = await self.consumer.fetch(batch=64, timeout=FETCH_TIMEOUT)
            except Exception as exc:  # reconnecting: the next fetch works again
                if self.bus.nc.is_closed:
                    return
                log.debug("trainer: fetch failed: %s", exc)
                await asyncio.sleep(0.2)
                continue
            for batch, delivery in got:
                await self.add(batch, delivery)

    async def add(self, batch: RolloutBatch, delivery: Delivery) -> None:
        try:
            tenant, subject_run = per_run_subject(delivery.subject)
        except ValueError:
            tenant, subject_run = DEFAULT_TENANT, None
        if subject_run != batch.run_id:
            await delivery.term()
            await self.bus.report_invalid(
                delivery.subject,
                f"RolloutBatch of {batch.run_id} published on {delivery.subject}: a run's batches "
                f"go to plexrl.rollouts[.<tenant>].{batch.run_id}",
                delivery.msg.data,
            )
            return
        fresh = Held(batch, delivery, tenant=tenant)
        owner = self.tenant_of(batch.run_id)
        if owner is not None and owner != tenant:
            await self._refuse(fresh, owner)
            return
        steps = self.pending.setdefault(batch.run_id, {})
        held = steps.get(batch.step)
        if held is None:
            steps[batch.step] = fresh
        elif held.delivery.stream_sequence == delivery.stream_sequence:
            held.delivery = delivery  # the same message redelivered: the newest delivery acks it
        elif held.tenant != tenant or held.rivals:
            rival = next((r for r in held.rivals if r.tenant == tenant), None)
            if rival is None and held.tenant != tenant:
                held.rivals.append(fresh)  # which one is the run's: known once the run is
            elif rival is not None and rival.delivery.stream_sequence == delivery.stream_sequence:
                rival.delivery = delivery
            else:
                await delivery.ack()  # a republish by the same tenant: the earlier one stays
                self.num_skipped += 1
        else:
            # Two messages for one step: the orchestrator republished it after the stream's
            # deduplication window. The earlier one is kept, whichever arrived first here.
            keep, extra = (
                (held, fresh)
                if held.delivery.stream_sequence < delivery.stream_sequence
                else (fresh, held)
            )
            steps[batch.step] = keep
            log.warning(
                "trainer: %s step %d arrived twice (stream sequences %d and %d); keeping %d",
                batch.run_id,
                batch.step,
                held.delivery.stream_sequence,
                delivery.stream_sequence,
                keep.delivery.stream_sequence,
            )
            await extra.delivery.ack()
            self.num_skipped += 1
        self.arrived.set()

    # --- deciding ------------------------------------------------------------------------------

    async def select(self, runs: Mapping[str, RunSteps], skip: Collection[str] = ()) -> Selection:
        """Take every trainable batch out of the table; settle what is done or gone.

        Runs in ``skip`` (already given a batch this step) are left as they are.
        """
        out = Selection()
        now = time.monotonic()
        for run_id in [r for r in self.pending if r not in skip]:
            steps = self.pending[run_id]
            view = runs.get(run_id)
            if view is None:
                await self._unknown(run_id, steps, now)
            elif view.evicting:
                await self._drop(run_id, steps)
            else:
                await self._settle_tenants(run_id, steps)
                for step in sorted(steps):
                    where = place(step, view.next_step, view.committed_step)
                    if where == "wait":
                        continue
                    held = steps.pop(step)
                    if where == "done":
                        await held.delivery.ack()
                        self.num_skipped += 1
                    elif where == "uncommitted":
                        out.uncommitted.append(held)
                    else:
                        out.train[run_id] = held
            if not steps:
                self.pending.pop(run_id, None)
        return out

    def has_trainable(self, runs: Mapping[str, RunSteps]) -> bool:
        """Whether :meth:`select` would return a batch to train right now."""
        for run_id, steps in self.pending.items():
            view = runs.get(run_id)
            if view is not None and not view.evicting and view.next_step in steps:
                return True
        return False

    async def _settle_tenants(self, run_id: str, steps: dict[int, Held]) -> None:
        """Refuse the batches of a now known run that came from another tenant than its own."""
        owner = self.tenant_of(run_id)
        if owner is None:
            return
        for step in list(steps):
            candidates = list(steps[step].all())
            if len(candidates) == 1 and candidates[0].tenant == owner:
                continue
            rightful = [h for h in candidates if h.tenant == owner]
            for held in candidates:
                held.rivals = []
                if held.tenant != owner:
                    await self._refuse(held, owner)
            if rightful:
                steps[step] = rightful[0]
            else:
                del steps[step]

    async def _refuse(self, held: Held, owner: str) -> None:
        """Terminate and report a batch sent for another tenant's run; the run is not touched."""
        self.num_wrong_tenant += 1
        run_id, subject = held.batch.run_id, held.delivery.subject
        error = (
            f"tenant {held.tenant!r} sent a RolloutBatch (step {held.batch.step}) for {run_id}, "
            f"which belongs to tenant {owner!r}, on {subject}: refused; a tenant sends batches "
            "of its own runs only"
        )
        log.warning("trainer: %s", error)
        await held.delivery.term()
        await self.bus.report_invalid(subject, error, held.delivery.msg.data)

    async def _unknown(self, run_id: str, steps: dict[int, Held], now: float) -> None:
        if run_id in self.removed or await self._registry_status(run_id) in GONE_STATUSES:
            await self._drop(run_id, steps)
            return
        for step in [s for s, h in steps.items() if now - h.first_seen >= self.unknown_run_hold]:
            log.info("trainer: %s is not known yet; batch step %d handed back", run_id, step)
            for held in steps.pop(step).all():
                await held.delivery.nak(delay=max(self.unknown_run_hold, 0.5))

    async def _drop(self, run_id: str, steps: dict[int, Held]) -> None:
        for held in [h for first in steps.values() for h in first.all()]:
            await held.delivery.ack()
            self.num_dropped += 1
        if steps:
            log.info("trainer: dropped %d batches of %s (evicted or gone)", len(steps), run_id)
        steps.clear()

    async def _registry_status(self, run_id: str) -> RunStatus | None:
        """The run's status in the registry's table (cached a second), None if it has none."""
        cached = self._status_cache.get(run_id)
        if cached is not None and time.monotonic() - cached[0] < 1.0:
            return cached[1]
        status: RunStatus | None = None
        try:
            record = await read_record(self.bus, run_id)
            status = record.status if record else None
        except Exception as exc:  # no table yet, or unreadable: treat the run as not known yet
            log.debug("trainer: registry status of %s unavailable: %s", run_id, exc)
        self._status_cache[run_id] = (time.monotonic(), status)
        return status

    # --- keeping and letting go ----------------------------------------------------------------

    async def keep_alive(self, others: Iterable[Delivery] = ()) -> None:
        """Reset the ack timer of every held batch and of ``others`` (in flight, uncommitted)."""
        deliveries = [
            h.delivery for steps in self.pending.values() for f in steps.values() for h in f.all()
        ]
        for delivery in [*deliveries, *others]:
            try:
                await delivery.in_progress()
            except Exception as exc:  # a closed connection: redelivery is the fallback
                log.debug("trainer: in-progress signal failed: %s", exc)

    async def release(self) -> None:
        """Hand every held batch back to the server (a clean stop): another trainer gets them.

        Call after :meth:`pump` returned. A pull request outlives the fetch that made it by up to
        its expiry, and a message the server hands to it after that would sit unacked until
        ``ack_wait`` runs out; so wait for the pump's last request to expire, take in whatever
        it delivered, wait for that probe's request to expire as well, and only then nak.
        """
        await asyncio.sleep(FETCH_TIMEOUT + 0.05)
        while got := await self.consumer.fetch(batch=64, timeout=0.05):
            for batch, delivery in got:
                await self.add(batch, delivery)
        await asyncio.sleep(0.1)
        for steps in self.pending.values():
            for held in [h for first in steps.values() for h in first.all()]:
                try:
                    await held.delivery.nak()
                except Exception as exc:
                    log.debug("trainer: nak failed: %s", exc)
        self.pending.clear()
        with contextlib.suppress(Exception):  # naks are fire-and-forget: send them before leaving
            await self.bus.nc.flush(timeout=2)
