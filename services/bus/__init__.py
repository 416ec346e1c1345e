"""The NATS layer every service stands on: connection, provisioning, typed publish and consume."""

from services.bus.bus import Bus, flushed
from services.bus.consumer import Consumer, Delivery
from services.bus.errors import (
    BusUnavailable,
    PayloadTooLarge,
    Reject,
    Retry,
    StoppedWaiting,
    StorageFull,
)
from services.bus.follower import Follower, MessageMeta
from services.bus.provision import provision
from services.bus.server import EmbeddedNats, find_nats_server, free_port
from services.bus.shutdown import stop_on_signals
from services.bus.tracing import setup_tracing

__all__ = [
    "Bus",
    "BusUnavailable",
    "Consumer",
    "Delivery",
    "EmbeddedNats",
    "Follower",
    "MessageMeta",
    "PayloadTooLarge",
    "Reject",
    "Retry",
    "StoppedWaiting",
    "StorageFull",
    "find_nats_server",
    "flushed",
    "free_port",
    "provision",
    "setup_tracing",
    "stop_on_signals",
]
