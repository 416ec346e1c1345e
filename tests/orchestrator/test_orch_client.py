"""The generate client against a real nats-server: what it retries, what it does not."""

from __future__ import annotations

import asyncio
import logging

import pytest

from schemas.events import GenerateRequest
from services.bus import Bus
from services.model.tokenizer import character_vocab
from services.orchestrator.client import (
    GenerateClient,
    GenerationError,
    GenerationStopped,
    is_retryable_error,
)

from .conftest import RUN
from .replica import ScriptedReplica, eventually

VOCAB = character_vocab()


def _request(min_version: int = 0) -> GenerateRequest:
    prompt = [VOCAB["<bos>"], *(VOCAB[c] for c in "reverse: abc=")]
    return GenerateRequest(
        request_id=f"{RUN}/step_0/prompt_0",
        run_id=RUN,
        prompts=[prompt],
        n=2,
        max_tokens=4,
        min_policy_version=min_version,
        seed=1,
        timeout_s=1.0,
    )


@pytest.mark.parametrize(
    ("error", "retryable"),
    [
        ("policy version 3 of run_a not loaded yet (have 2)", True),
        ("run_a is not known yet", True),
        ("unknown run run_a: no run with this id is registered here (submit it first)", True),
        (
            "run_a: this replica has policy version 0 but the request asks for "
            "min_policy_version 1; gave up after waiting 60s (timeout_s) for it",
            True,
        ),
        ("run_a cannot be served by this replica: rank 64 > max_lora_rank 32", False),
        ("generation failed: CUDA error", False),
        ("replica busy", True),
        ("shutting down", True),
        ("prompt of 900 tokens exceeds the model's context of 256", False),
        ("invalid request: n must be >= 1", False),
    ],
)
def test_which_errors_are_retried(error: str, retryable: bool) -> None:
    assert is_retryable_error(error) is retryable


async def test_no_responders_then_a_replica_appears(
    obus: Bus, replica: ScriptedReplica, caplog: pytest.LogCaptureFixture
) -> None:
    await replica.stop()  # nobody listens yet
    client = GenerateClient(obus, timeout=2.0, initial_backoff=0.05, max_backoff=0.2)
    caplog.set_level(logging.WARNING, logger="services.orchestrator.client")
    task = asyncio.create_task(client.generate(_request()))
    await asyncio.sleep(0.4)
    assert not task.done()
    await replica.start()
    response = await asyncio.wait_for(task, 5.0)
    assert response.error is None
    # the scripted replica's sample k is the first k characters of "cba", then <eos>
    assert [c.token_ids for c in response.completions[0]] == [
        [VOCAB["<eos>"]],
        [VOCAB["c"], VOCAB["<eos>"]],
    ]
    assert client.retries >= 2
    assert "no inference replica listens on plexrl.inference.generate" in caplog.text
    assert f"{RUN}/step_0/prompt_0" in caplog.text


async def test_version_not_loaded_yet_is_retried_until_it_is(
    obus: Bus, replica: ScriptedReplica
) -> None:
    client = GenerateClient(obus, timeout=2.0, initial_backoff=0.05, max_backoff=0.1)
    task = asyncio.create_task(client.generate(_request(min_version=2)))
    await asyncio.sleep(0.3)
    assert not task.done() and replica.refusals >= 2
    replica.version = 2
    response = await asyncio.wait_for(task, 5.0)
    assert response.policy_version == 2 and response.error is None


async def test_a_final_error_is_raised_at_once(obus: Bus, replica: ScriptedReplica) -> None:
    replica.errors = ["prompt exceeds the model's context"]
    client = GenerateClient(obus, timeout=2.0)
    with pytest.raises(GenerationError, match="prompt exceeds the model's context"):
        await client.generate(_request())
    assert client.retries == 0 and len(replica.requests) == 1


async def test_timeouts_are_retried_and_max_attempts_gives_up(
    obus: Bus, replica: ScriptedReplica
) -> None:
    replica.delay = 0.5  # slower than the client's timeout
    client = GenerateClient(
        obus, timeout=0.1, initial_backoff=0.01, max_backoff=0.01, max_attempts=3
    )
    with pytest.raises(
        GenerationError, match=r"giving up after 3 attempts; last: no reply within 0.1s"
    ):
        await client.generate(_request())
    assert client.retries == 2


async def test_stop_ends_the_retries(obus: Bus, replica: ScriptedReplica) -> None:
    stop = asyncio.Event()
    # a backoff no test waits out: the request can only end by the stop cutting it short
    client = GenerateClient(obus, timeout=2.0, stop=stop, initial_backoff=3600.0)
    task = asyncio.create_task(client.generate(_request(min_version=9)))
    await eventually(lambda: _true(client.retries == 1))  # refused once, now backing off
    stop.set()
    with pytest.raises(GenerationStopped):
        await asyncio.wait_for(task, 60.0)  # bounds a hang only
    assert (client.retries, replica.refusals, len(replica.requests)) == (1, 1, 1)


async def test_one_warning_per_reason_not_one_per_request(
    obus: Bus, replica: ScriptedReplica, caplog: pytest.LogCaptureFixture
) -> None:
    replica.errors = ["replica busy"] * 8
    client = GenerateClient(obus, timeout=2.0, initial_backoff=0.01, max_backoff=0.01)
    caplog.set_level(logging.DEBUG, logger="services.orchestrator.client")
    responses = await asyncio.gather(*(client.generate(_request()) for _ in range(4)))
    assert all(r.error is None for r in responses)
    assert client.retries == 8
    retry_lines = [r for r in caplog.records if "inference answered: replica busy" in r.message]
    assert len(retry_lines) == 8
    assert [r.levelno for r in retry_lines].count(logging.WARNING) == 1


# --- liveness of the replica holding a request ---------------------------------------------------


async def test_a_replica_silent_after_progress_is_left_at_once(
    obus: Bus, replica: ScriptedReplica, caplog: pytest.LogCaptureFixture
) -> None:
    replica.holds = 1  # takes the first attempt, says so once, then nothing: dead
    client = GenerateClient(obus, timeout=600.0, progress_every_s=0.1)
    caplog.set_level(logging.WARNING, logger="services.orchestrator.client")
    response = await asyncio.wait_for(client.generate(_request()), 60)
    assert response.error is None and len(response.completions[0]) == 2
    assert len(replica.requests) == 2 and client.retries == 1
    assert (client.progress_received, client.silent_replicas) == (1, 1)
    inboxes = {r.progress_subject for r in replica.requests}
    assert len(inboxes) == 2 and all(s and s.startswith("_INBOX.") for s in inboxes)
    assert {r.progress_every_s for r in replica.requests} == {0.1}
    (warning,) = [r.getMessage() for r in caplog.records if "went silent" in r.getMessage()]
    assert warning.startswith("replica scripted went silent for ")
    assert warning.endswith(f"while holding request {RUN}/step_0/prompt_0; retrying")


async def test_silence_counts_against_max_attempts(obus: Bus, replica: ScriptedReplica) -> None:
    replica.holds = 2
    client = GenerateClient(obus, timeout=600.0, progress_every_s=0.1, max_attempts=2)
    with pytest.raises(
        GenerationError, match=r"giving up after 2 attempts; last: replica scripted"
    ):
        await asyncio.wait_for(client.generate(_request()), 60)


async def test_no_progress_leaves_the_attempt_to_its_timeout(
    obus: Bus, replica: ScriptedReplica
) -> None:
    """A replica that never sends progress (one older than the field) is not presumed dead."""
    replica.delay = 3.0  # longer than the silence limit of 2.3 s, shorter than the timeout
    client = GenerateClient(obus, timeout=10.0, progress_every_s=0.1)
    response = await asyncio.wait_for(client.generate(_request()), 30)
    assert response.error is None and client.retries == 0 and client.silent_replicas == 0
    assert client.progress_received == 0 and len(replica.requests) == 1


async def test_once_replicas_speak_an_attempt_that_hears_nothing_is_left(
    obus: Bus, replica: ScriptedReplica
) -> None:
    """A replica killed the moment it took a request says nothing at all; once this client
    has heard progress from replicas, that silence is as telling as a silence after progress."""
    replica.holds = 1  # progress once, then dead: the client learns that replicas speak
    client = GenerateClient(obus, timeout=600.0, progress_every_s=0.1)
    await asyncio.wait_for(client.generate(_request()), 60)
    assert (client.progress_received, client.silent_replicas) == (1, 1)
    replica.drops = 1
    response = await asyncio.wait_for(client.generate(_request()), 60)
    assert response.error is None and client.silent_replicas == 2
    assert len(replica.requests) == 4 and client.progress_received == 1


async def test_progress_off_sends_the_request_as_before(
    obus: Bus, replica: ScriptedReplica
) -> None:
    client = GenerateClient(obus, timeout=5.0, progress_every_s=0)
    assert (await client.generate(_request())).error is None
    assert replica.requests[-1].progress_subject is None
    with pytest.raises(ValueError, match="progress_every_s must be 0"):
        GenerateClient(obus, timeout=5.0, progress_every_s=0.05)


async def test_progress_inboxes_are_unsubscribed_after_each_request(
    obus: Bus, replica: ScriptedReplica
) -> None:
    client = GenerateClient(obus, timeout=5.0, initial_backoff=0.01, progress_every_s=0.1)
    await client.generate(_request())  # the connection's request inbox exists from here on
    before = len(obus.nc._subs)
    replica.errors = ["replica busy"] * 5  # retried attempts subscribe and unsubscribe too
    await asyncio.gather(*(client.generate(_request()) for _ in range(20)))
    replica.holds = 1
    await client.generate(_request())  # an abandoned attempt too
    assert client.silent_replicas == 1
    assert len(obus.nc._subs) == before
    assert len({r.progress_subject for r in replica.requests}) == len(replica.requests) == 28


async def _true(value: bool) -> bool:
    return value
