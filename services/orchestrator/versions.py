"""The newest policy version the trainer has announced for one run.

The trainer announces version ``v`` of a run's adapter with ``WeightsReady(step=v)`` on
``plexrl.weights.<run_id>`` (``plexrl.weights.<tenant>.<run_id>`` for a run of a tenant other
than ``default``) once the weights are stored, so inference can load them; version 0
(the base model, LoRA B = 0) needs no announcement. :class:`PolicyVersions` replays the few
announcements the stream keeps per run and follows new ones with a
:class:`~services.bus.Follower`, so ``latest`` is right from the start even for an orchestrator
restarted mid-run.

This is the clock of the off-policy bound: the run loop builds step ``n`` only once
``latest >= n - max_async_level``, and a run is finished when ``latest`` reaches ``max_steps``.

Announcements stored before ``since`` (the start of this incarnation of the run id, see
:mod:`services.orchestrator.lifecycle`) belong to a deleted run of the same id and are ignored.
"""

from __future__ import annotations

import logging
from datetime import datetime

from schemas.events import WeightsReady
from schemas.subjects import WEIGHTS_STREAM, tenant_weights_subject
from services.bus import Bus, Follower, MessageMeta
from services.orchestrator.lifecycle import acting_tenant

log = logging.getLogger(__name__)


class PolicyVersions:
    """Tracks ``latest``, the highest ``WeightsReady.step`` seen for ``run_id`` (0 before any).

    ``tenant`` (default: the tenant this process acts for) picks the run's weights subject.
    """

    def __init__(
        self, bus: Bus, run_id: str, *, since: datetime | None = None, tenant: str | None = None
    ) -> None:
        self.bus = bus
        self.run_id = run_id
        self.since = since
        self.tenant = acting_tenant(tenant)
        self.latest = 0
        self._follower: Follower[WeightsReady] = Follower(
            bus,
            WEIGHTS_STREAM,
            tenant_weights_subject(run_id, self.tenant),
            WeightsReady,
            self._on_event,
        )

    async def start(self) -> None:
        await self._follower.start()
        # Wait for the replay, so that a restarted orchestrator does not block on a bound that
        # an announcement it has not read yet already satisfies.
        await self._follower.wait_until_caught_up(timeout=30.0)

    async def stop(self) -> None:
        await self._follower.stop()

    def _on_event(self, seq: int, event: WeightsReady, meta: MessageMeta) -> None:
        if (
            event.run_id == self.run_id
            and (self.since is None or meta.time >= self.since)
            and event.step > self.latest
        ):
            self.latest = event.step
            log.debug("%s: policy version %d announced", self.run_id, event.step)

    async def wait_for(self, version: int) -> int:
        """Wait until version ``version`` or newer has been announced; returns ``latest``."""
        await self._follower.wait(lambda: self.latest >= version)
        return self.latest
