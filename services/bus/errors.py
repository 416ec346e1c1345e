"""How a handler tells the consumer loop what to do with a message it could not process."""

from __future__ import annotations


class BusUnavailable(ConnectionError):
    """No NATS server could be reached; the message says where we looked and what to do."""


class Reject(Exception):
    """The message is bad and will never succeed: terminate it and report InvalidMessage."""


class Retry(Exception):
    """A transient failure: negatively acknowledge so the server redelivers after ``delay``."""

    def __init__(self, reason: str = "", delay: float = 1.0) -> None:
        super().__init__(reason)
        self.delay = delay


class PayloadTooLarge(ValueError):
    """An encoded event exceeds the server's max payload; big things travel by reference."""
