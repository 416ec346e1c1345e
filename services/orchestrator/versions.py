"""The newest policy version the trainer has announced for one run.

The trainer announces version ``v`` of a run's adapter with ``WeightsReady(step=v)`` on
``plexrl.weights.<run_id>`` once the weights are stored, so inference can load them; version 0
(the base model, LoRA B = 0) needs no announcement. :class:`PolicyVersions` replays the few
announcements the stream keeps per run and follows new ones with an ordered consumer, so
``latest`` is right from the start even for an orchestrator restarted mid-run.

This is the clock of the off-policy bound: the run loop builds step ``n`` only once
``latest >= n - max_async_level``, and a run is finished when ``latest`` reaches ``max_steps``.

Announcements stored before ``since`` (the start of this incarnation of the run id, see
:mod:`services.orchestrator.lifecycle`) belong to a deleted run of the same id and are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Any

from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from schemas.codec import DecodeError, decode
from schemas.events import WeightsReady
from schemas.subjects import WEIGHTS_STREAM, weights_subject
from services.bus import Bus

log = logging.getLogger(__name__)


class PolicyVersions:
    """Tracks ``latest``, the highest ``WeightsReady.step`` seen for ``run_id`` (0 before any)."""

    def __init__(self, bus: Bus, run_id: str, *, since: datetime | None = None) -> None:
        self.bus = bus
        self.run_id = run_id
        self.since = since
        self.latest = 0
        self._seen_seq = 0
        self._changed = asyncio.Condition()
        self._sub: Any = None

    async def start(self) -> None:
        if self._sub is not None:
            return
        subject = weights_subject(self.run_id)
        self._sub = await self.bus.js.subscribe(
            subject,
            stream=WEIGHTS_STREAM,
            cb=self._on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.ALL,
        )
        # Wait for the replay, so that a restarted orchestrator does not block on a bound that
        # an announcement it has not read yet already satisfies.
        try:
            last = (await self.bus.js.get_last_msg(WEIGHTS_STREAM, subject)).seq or 0
        except NotFoundError:
            return
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: self._seen_seq >= last), timeout=30.0
            )

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.bus.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection may be closing under us
                log.debug("policy versions: unsubscribe failed: %s", exc)

    async def _on_msg(self, msg: Msg) -> None:
        stored_at = msg.metadata.timestamp
        event: WeightsReady | None
        try:
            event = decode(msg.data, WeightsReady, (msg.headers or {}).get("Content-Type"))
        except DecodeError as exc:
            log.warning("%s: ignoring an undecodable WeightsReady: %s", self.run_id, exc)
            event = None
        async with self._changed:
            self._seen_seq = max(self._seen_seq, msg.metadata.sequence.stream)
            if (
                event is not None
                and event.run_id == self.run_id
                and (self.since is None or stored_at >= self.since)
                and event.step > self.latest
            ):
                self.latest = event.step
                log.debug("%s: policy version %d announced", self.run_id, event.step)
            self._changed.notify_all()

    async def wait_for(self, version: int) -> int:
        """Wait until version ``version`` or newer has been announced; returns ``latest``."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.latest >= version)
            return self.latest
