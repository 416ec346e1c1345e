"""The run-state KV buckets, one handle per connection and bucket (a lookup costs a round trip)."""

from __future__ import annotations

import weakref

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
