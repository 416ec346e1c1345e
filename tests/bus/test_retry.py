"""with_backoff: what it retries, how long it pauses, and when it gives up."""

from __future__ import annotations

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from services.bus.retry import with_backoff


class Flaky:
    """Fails ``failures`` times with ``error``, then answers 42."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> int:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return 42


async def test_transient_failures_are_retried_with_doubling_pauses() -> None:
    op, pauses = Flaky(3, NoRespondersError()), []
    got = await with_backoff(
        op, attempts=5, first_delay=0.001, max_delay=0.003,
        on_retry=lambda exc, n, pause: pauses.append((type(exc).__name__, n, pause)),
    )  # fmt: skip
    assert got == 42 and op.calls == 4
    assert pauses == [
        ("NoRespondersError", 1, 0.001),
        ("NoRespondersError", 2, 0.002),
        ("NoRespondersError", 3, 0.003),
    ]


async def test_the_last_failure_is_raised_after_every_attempt() -> None:
    op = Flaky(10, NatsTimeout())
    with pytest.raises(NatsTimeout):
        await with_backoff(op, attempts=3, first_delay=0.001, max_delay=0.001)
    assert op.calls == 3


async def test_other_errors_and_a_closed_connection_are_not_retried() -> None:
    op = Flaky(1, ValueError("bad input"))
    with pytest.raises(ValueError, match="bad input"):
        await with_backoff(op, attempts=5, first_delay=0.001, max_delay=0.001)
    assert op.calls == 1
    op = Flaky(5, NoRespondersError())
    with pytest.raises(NoRespondersError):
        await with_backoff(op, attempts=5, first_delay=0.001, max_delay=0.001, give_up=lambda: True)
    assert op.calls == 1
