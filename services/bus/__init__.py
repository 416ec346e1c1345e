"""The NATS layer every service stands on: connection, provisioning, typed publish and consume."""

from services.bus.bus import Bus, errors_subject
from services.bus.consumer import Consumer, Delivery
from services.bus.errors import BusUnavailable, PayloadTooLarge, Reject, Retry
from services.bus.follower import Follower, MessageMeta, Start
from services.bus.provision import KV_BUCKETS, OBJECT_STORE, STREAMS, provision
from services.bus.server import EmbeddedNats, NatsServerError, find_nats_server, free_port
from services.bus.shutdown import stop_on_signals
from services.bus.tracing import setup_tracing

__all__ = [
    "KV_BUCKETS",
    "OBJECT_STORE",
    "STREAMS",
    "Bus",
    "BusUnavailable",
    "Consumer",
    "Delivery",
    "EmbeddedNats",
    "Follower",
    "MessageMeta",
    "NatsServerError",
    "PayloadTooLarge",
    "Reject",
    "Retry",
    "Start",
    "errors_subject",
    "find_nats_server",
    "free_port",
    "provision",
    "setup_tracing",
    "stop_on_signals",
]
