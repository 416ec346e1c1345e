"""The last message on a subject, read the way a tenant's credentials allow.

The services read the last message of a subject with the stream's message-get API. A tenant
may not use it, nor direct get: a direct-get answer goes to whatever reply subject the requester names, and a stream stores it
like any publish, so direct get on the shared streams is not in a tenant's permissions
(services/tenants/permissions.py). A tenant may create a consumer whose API subject names its
own filter, so :func:`last_message` reads through a consumer that starts at the last message
matching the filter and delivers just that one. The create reply says whether there is any
message at all, so absence needs no timeout; the server removes the consumer after a few
seconds idle, since a tenant may not delete it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from datetime import datetime

from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from schemas.tenant import DEFAULT_TENANT
from services.bus.bus import Bus


@dataclass(frozen=True)
class StoredMessage:
    """A stored message: its payload, headers, stream sequence and time."""

    data: bytes
    headers: dict[str, str]
    seq: int
    time: datetime | None


async def last_message(
    bus: Bus, stream: str, subject: str, *, tenant: str = DEFAULT_TENANT, timeout: float = 10.0
) -> StoredMessage | None:
    """The last message of ``stream`` matching ``subject`` (wildcards allowed), or None.

    The default tenant reads with the stream's message-get API (answered by the stream leader,
    so never stale; while JetStream is unavailable it waits as long as the bus's
    ``outage_wait`` allows); any other tenant through a one-message consumer.
    """
    if tenant == DEFAULT_TENANT:

        async def get() -> StoredMessage | None:
            try:
                raw = await bus.js.get_last_msg(stream, subject)
            except NotFoundError:
                return None
            return StoredMessage(raw.data or b"", dict(raw.headers or {}), raw.seq or 0, raw.time)

        return await bus.until_available(get, f"reading the last message on {subject}")
    return await _through_consumer(bus, stream, subject, timeout)


async def _through_consumer(
    bus: Bus, stream: str, subject: str, timeout: float
) -> StoredMessage | None:
    arrived: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()

    async def on_msg(msg: Msg) -> None:
        if not arrived.done():
            arrived.set_result(msg)

    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, cb=on_msg)
    try:
        info = await bus.js.add_consumer(
            stream,
            api.ConsumerConfig(
                name=f"plexrl_last_{uuid.uuid4().hex}",
                filter_subject=subject,
                deliver_subject=inbox,
                deliver_policy=api.DeliverPolicy.LAST,
                ack_policy=api.AckPolicy.NONE,
                max_deliver=1,
                mem_storage=True,
                num_replicas=1,
                inactive_threshold=5.0,
            ),
        )
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if not (info.num_pending or delivered):
            return None
        try:
            msg = await asyncio.wait_for(arrived, timeout)
        except TimeoutError:
            raise TimeoutError(
                f"the last message on {subject} ({stream}) was not delivered within {timeout}s"
            ) from None
    finally:
        with contextlib.suppress(Exception):  # the connection may be closing under us
            await sub.unsubscribe()
    meta = msg.metadata
    return StoredMessage(msg.data, dict(msg.headers or {}), meta.sequence.stream, meta.timestamp)
