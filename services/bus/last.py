"""The last message on a subject of a stream.

Every client reads it with the stream's message-get API, answered by the stream's leader, so
never stale: a client of the services account from the services' streams, a tenant's client
from the views the registry keeps in the tenant's own account (:mod:`services.tenants.views`).
A stream the client's account does not have holds no message for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from nats.js.errors import NotFoundError

from services.bus.bus import Bus


@dataclass(frozen=True)
class StoredMessage:
    """A stored message: its payload, headers, stream sequence and time."""

    data: bytes
    headers: dict[str, str]
    seq: int
    time: datetime | None


async def last_message(bus: Bus, stream: str, subject: str) -> StoredMessage | None:
    """The last message of ``stream`` matching ``subject`` (wildcards allowed), or None when
    there is none (or no such stream). While JetStream is unavailable this waits as long as the
    bus's ``outage_wait`` allows."""

    async def get() -> StoredMessage | None:
        try:
            raw = await bus.js.get_last_msg(stream, subject)
        except NotFoundError:
            return None
        return StoredMessage(raw.data or b"", dict(raw.headers or {}), raw.seq or 0, raw.time)

    return await bus.until_available(get, f"reading the last message on {subject}")
