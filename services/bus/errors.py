"""How a handler tells the consumer loop what to do with a message it could not process."""

from __future__ import annotations


class BusUnavailable(ConnectionError):
    """No NATS server could be reached; the message says where we looked and what to do."""


class StoppedWaiting(BusUnavailable):
    """The service was asked to stop (SIGTERM) while an operation waited for JetStream to
    answer again or for room in a full store: the operation is not done. The service exits as
    if it had crashed there, which every service recovers from on its next start."""


class Reject(Exception):
    """The message is bad and will never succeed: terminate it and report InvalidMessage."""


class Retry(Exception):
    """A transient failure: negatively acknowledge so the server redelivers after ``delay``."""

    def __init__(self, reason: str = "", delay: float = 1.0) -> None:
        super().__init__(reason)
        self.delay = delay


class PayloadTooLarge(ValueError):
    """An encoded event exceeds the server's max payload; big things travel by reference."""


class StorageFull(RuntimeError):
    """A stream, KV bucket or object store refused a write because it is full, or the server's
    whole JetStream store is. The message names it, its limit and what to do.

    ``where`` is what refused ("stream PLEXRL_ROLLOUTS", "object store plexrl-weights"),
    ``setting`` the variable that raises its limit (empty when the server itself is full),
    ``server`` whether the server's JetStream store (its ``max_file_store`` or the disk) is full
    rather than this one limit. Writers that must not lose data wait while it lasts
    (:func:`services.bus.limits.wait_while_full`); nothing was stored.
    """

    def __init__(self, message: str, *, where: str, setting: str = "", server: bool = False):
        super().__init__(message)
        self.where = where
        self.setting = setting
        self.server = server
