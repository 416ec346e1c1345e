"""with_backoff: what it retries, how long it pauses, and when it gives up."""

from __future__ import annotations

import asyncio
import logging
import math

import pytest
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from services.bus import retry
from services.bus.errors import StorageFull
from services.bus.retry import Servers, unavailable, with_backoff


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


def test_what_counts_as_jetstream_unavailable() -> None:
    no_quorum = ServiceUnavailableError(
        code=503, err_code=10008, description="JetStream system temporarily unavailable"
    )
    full = ServiceUnavailableError(code=503, err_code=10077, description="maximum bytes exceeded")
    waiting = [
        no_quorum,
        NoRespondersError(),
        NoStreamResponseError(),
        NatsTimeout(),
        ServiceUnavailableError(),  # a bare 503 status: no responders to a direct get
        APIError(code=409, err_code=10158, description="duplicate message id is in process"),
    ]
    answers = [full, NotFoundError(code=404, err_code=10059), ValueError("bad"), KeyError("k")]
    assert [unavailable(e) for e in waiting] == [True] * len(waiting)
    assert [unavailable(e) for e in answers] == [False] * len(answers)
    # an error raised from one (a failed object write) is one too; a full store is not
    try:
        raise RuntimeError("could not store the object") from no_quorum
    except RuntimeError as wrapped:
        assert unavailable(wrapped)
    try:
        raise StorageFull("full", where="stream X") from full
    except StorageFull as wrapped:
        assert not unavailable(wrapped)


async def test_an_outage_is_waited_out_past_the_attempts_and_logged_once_each_way(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(retry, "REPORT_AFTER", 0.0)
    caplog.set_level(logging.WARNING, logger="services.bus.retry")
    op, retries = Flaky(12, NoStreamResponseError()), []
    got = await with_backoff(
        op, attempts=2, first_delay=0.001, max_delay=0.002, outage_wait=math.inf,
        what="publishing X", on_retry=lambda exc, n, pause: retries.append(n),
    )  # fmt: skip
    assert got == 42 and op.calls == 13
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith("publishing X: JetStream is unavailable (no quorum")
    assert "waiting for as long as it lasts, retrying every 0.002s" in said[0]
    assert said[1].startswith("publishing X: JetStream answers again: resumed after")
    assert retries == []  # the caller's own retry messages stop once the wait is reported


async def test_an_outage_wait_is_bounded_and_other_errors_are_not_waited_on() -> None:
    op = Flaky(10**6, NatsTimeout())
    with pytest.raises(NatsTimeout):
        await with_backoff(op, attempts=1, first_delay=0.01, max_delay=0.01, outage_wait=0.1)
    assert 5 <= op.calls <= 12
    op = Flaky(5, NotFoundError(code=404, err_code=10059))
    with pytest.raises(NotFoundError):
        await with_backoff(op, attempts=3, first_delay=0.001, max_delay=0.001, outage_wait=60)
    assert op.calls == 1


async def test_a_try_left_unanswered_while_most_servers_are_gone_is_reported_at_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request to a stream leader that lost its quorum may wait out a long timeout before it
    fails: the wait is reported once the try has gone unanswered for STUCK_AFTER seconds, if
    most servers are unreachable, and not when they are all there (a slow answer)."""
    monkeypatch.setattr(retry, "STUCK_AFTER", 0.05)
    caplog.set_level(logging.WARNING, logger="services.bus.retry")

    async def slow() -> int:
        await asyncio.sleep(0.2)
        return 42

    async def gone() -> Servers:
        return Servers("JetStream has no quorum: only 1 of 3 NATS servers reachable", True)

    async def there() -> Servers:
        return Servers("JetStream is unavailable (3 of 3 NATS servers reachable ...)", False)

    for hint, said in ((there, 0), (gone, 2)):
        caplog.clear()
        got = await with_backoff(
            slow, attempts=1, first_delay=0.01, max_delay=0.01, outage_wait=math.inf,
            what="storing X", hint=hint,
        )  # fmt: skip
        assert got == 42
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == said, lines
    assert lines[0].startswith("storing X: JetStream has no quorum: only 1 of 3")
    assert "no answer for" in lines[0]
    assert lines[1].startswith("storing X: JetStream answers again: resumed after")


async def test_a_stuck_try_is_made_again_once_the_servers_are_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A try to a leader without its quorum may not be answered before its timeout (30 s for a
    chunk of an object), even after the quorum is back: once the servers are, it is abandoned
    and made again at once."""
    monkeypatch.setattr(retry, "STUCK_AFTER", 0.05)
    monkeypatch.setattr(retry, "RECHECK_S", 0.05)
    tries, looks = 0, 0

    async def write() -> int:
        nonlocal tries
        tries += 1
        if tries == 1:
            await asyncio.sleep(3600)  # sent to the leader while it had no quorum
        return 42

    async def servers() -> Servers:
        nonlocal looks
        looks += 1
        if looks <= 3:
            return Servers("JetStream has no quorum: only 1 of 3 NATS servers reachable", True)
        return Servers("JetStream is unavailable (3 of 3 NATS servers reachable ...)", False)

    got = await asyncio.wait_for(
        with_backoff(
            write, attempts=1, first_delay=0.01, max_delay=0.01, outage_wait=math.inf,
            what="storing X", hint=servers,
        ),
        30,
    )  # fmt: skip
    assert (got, tries) == (42, 2) and looks == 4
