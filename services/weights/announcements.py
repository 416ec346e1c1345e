"""The WeightsReady announcements a run's subject still holds on ``PLEXRL_WEIGHTS``.

The stream keeps each run's last few announcements; :func:`announced` finds the one of a given
version by walking that subject's messages with the stream's message-get API (a client of the
services account reads the services' stream, a tenant's client the view of it in its own
account: the same name and subjects). A version no longer there, or never announced, is None.
"""

from __future__ import annotations

from nats.js.errors import NotFoundError

from schemas import subjects as sj
from schemas.codec import DecodeError, decode
from schemas.events import WeightsReady
from services.bus import Bus


async def announced(bus: Bus, run_id: str, version: int, tenant: str) -> WeightsReady | None:
    """The WeightsReady of ``run_id`` at ``version`` still on the weights stream, or None."""
    subject = sj.tenant_weights_subject(run_id, tenant)
    seq = 1
    while True:
        try:
            raw = await bus.js.get_msg(sj.WEIGHTS_STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return None
        event: WeightsReady | None
        try:
            event = decode(raw.data or b"", WeightsReady, (raw.headers or {}).get("Content-Type"))
        except DecodeError:
            event = None
        if event is not None and event.run_id == run_id and event.step == version:
            return event
        seq = (raw.seq or seq) + 1
