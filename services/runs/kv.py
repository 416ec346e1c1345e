"""The run-state KV buckets, one handle per connection and bucket (a lookup costs a round trip)."""

from __future__ import annotations

import weakref

from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from services.bus import Bus

_handles: weakref.WeakKeyDictionary[Bus, dict[str, KeyValue]] = weakref.WeakKeyDictionary()


async def bucket(bus: Bus, name: str) -> KeyValue:
    """The KeyValue handle of bucket ``name`` on ``bus`` (looked up once; while JetStream is
    unavailable, as long as the bus's ``outage_wait`` allows)."""
    held = _handles.setdefault(bus, {})
    if name not in held:
        held[name] = await bus.until_available(
            lambda: bus.js.key_value(name), f"looking up KV bucket {name}"
        )
    return held[name]


async def read_value(bus: Bus, name: str, key: str, what: str) -> bytes | None:
    """The value of ``key`` in bucket ``name``, or None if it has none (never written, deleted
    or purged); while JetStream is unavailable it waits as long as the bus's ``outage_wait``
    allows, saying it waits for ``what``."""
    kv = await bucket(bus, name)

    async def get() -> bytes | None:
        try:
            return (await kv.get(key)).value
        except (KeyNotFoundError, KeyDeletedError):
            return None

    return await bus.until_available(get, what)
