"""Subjects, streams and buckets: the one table in schemas/subjects.py matches DESIGN.md, every
subject an event is published on is captured by its stream, and variable tokens are checked."""

from __future__ import annotations

import pytest

from schemas import subjects
from schemas.collective import COLLECTIVE_MESSAGES, GroupState
from schemas.events import (
    ALL_EVENTS,
    EvictRequested,
    RolloutBatch,
    RunSubmitted,
    ServiceError,
    event_tag,
)
from schemas.tenant import check_progress_subject, progress_inbox_prefix


def _captured_by(subject: str, wildcard: str) -> bool:
    """NATS subject matching: '*' is one token, '>' one or more trailing tokens."""
    s, w = subject.split("."), wildcard.split(".")
    for i, token in enumerate(w):
        if token == ">":
            return len(s) > i
        if i >= len(s) or token not in ("*", s[i]):
            return False
    return len(s) == len(w)


def test_names_are_the_public_ones() -> None:
    assert [s.name for s in subjects.STREAMS] == [
        "PLEXRL_RUNS",
        "PLEXRL_ROLLOUTS",
        "PLEXRL_WEIGHTS",
        "PLEXRL_ERRORS",
    ]
    assert (subjects.SUBMIT, subjects.DISCOVERED, subjects.INVALID) == (
        "plexrl.runs.submit",
        "plexrl.runs.discovered",
        "plexrl.runs.invalid",
    )
    assert (subjects.EVICT, subjects.EVICTED, subjects.FORGOTTEN) == (
        "plexrl.runs.evict",
        "plexrl.runs.evicted",
        "plexrl.runs.forgotten",
    )
    assert subjects.GENERATE == "plexrl.inference.generate"
    assert subjects.INFERENCE_QUEUE_GROUP == "inference"
    assert (subjects.KV_REGISTRY, subjects.KV_PROGRESS) == ("plexrl-registry", "plexrl-progress")
    assert subjects.OBJECT_STORE_WEIGHTS == "plexrl-weights"
    assert set(subjects.KV_BUCKETS) == {"plexrl-registry", "plexrl-progress"}


def test_every_event_has_exactly_one_channel() -> None:
    carried = [c for ch in subjects.CHANNELS for c in (*ch.messages, *ch.reply)]
    # A GroupState answers both a join and a leave, and so does a ServiceError (for a request
    # that does not decode), which is also an error report; every other message has one channel.
    carried.remove(GroupState)
    carried.remove(ServiceError)
    carried.remove(ServiceError)
    # A tenant's submit, evict and rollouts arrive on an ingest subject before the registry
    # stores them on their stream's subject (schemas/ingest.py): one more channel each.
    for tenants_write in (RunSubmitted, EvictRequested, RolloutBatch):
        carried.remove(tenants_write)
    expected = [*ALL_EVENTS, *COLLECTIVE_MESSAGES]
    assert sorted(carried, key=event_tag) == sorted(expected, key=event_tag)


def test_each_channel_is_captured_by_its_stream_only() -> None:
    for ch in subjects.CHANNELS:
        sample = ch.address.format(
            run_id="run_x",
            tenant="acme",
            service="trainer",
            group="g",
            member="m",
            progress_subject="_INBOX.Tq3Xw2cX8mLh0cV5q1Yz7A",
        )
        streams = [
            s.name for s in subjects.STREAMS if any(_captured_by(sample, w) for w in s.subjects)
        ]
        assert streams == ([ch.stream] if ch.stream else []), sample


def test_per_run_subjects_and_keys() -> None:
    assert subjects.rollouts_subject("run_abc123") == "plexrl.rollouts.run_abc123"
    assert subjects.weights_subject("run_abc123") == "plexrl.weights.run_abc123"
    assert subjects.run_id_from_subject("plexrl.rollouts.run_abc123") == "run_abc123"
    assert subjects.run_id_from_subject("plexrl.weights.run_x-1") == "run_x-1"
    assert subjects.rollout_msg_id("run_abc123", 12) == "run_abc123/step_12"
    assert subjects.weights_object_key("run_abc123", 13) == "run_abc123/step_13"


@pytest.mark.parametrize(
    "subject",
    ["plexrl.runs.submit", "plexrl.rollouts.run_a.b", "plexrl.rollouts.*", "plexrl.errors.trainer"],
)
def test_run_id_from_subject_rejects_anything_but_a_per_run_subject(subject: str) -> None:
    with pytest.raises(ValueError):
        subjects.run_id_from_subject(subject)


@pytest.mark.parametrize("step", [-1, True, 1.0, "3"], ids=repr)
def test_steps_in_keys_are_non_negative_integers(step: object) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        subjects.weights_object_key("run_a", step)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative integer"):
        subjects.rollout_msg_id("run_a", step)  # type: ignore[arg-type]


def test_errors_subject_takes_one_token_service_names() -> None:
    assert subjects.errors_subject("trainer") == "plexrl.errors.trainer"
    assert subjects.errors_subject("orchestrator-run_abc") == "plexrl.errors.orchestrator-run_abc"
    for bad in ("", "a.b", "*", ">", "a b", "x" * 65):
        with pytest.raises(ValueError, match="illegal service name"):
            subjects.errors_subject(bad)


def test_collective_subjects_are_per_group_and_checked() -> None:
    group = subjects.collective_subjects("blue")
    assert (group.join, group.leave, group.formed) == (
        "plexrl.collective.blue.join",
        "plexrl.collective.blue.leave",
        "plexrl.collective.blue.formed",
    )
    assert group.alive("inference-0-1a2b") == "plexrl.collective.blue.alive.inference-0-1a2b"
    assert subjects.collective_subjects().join == "plexrl.collective.default.join"
    for bad in ("a.b", "*", ""):
        with pytest.raises(ValueError, match="illegal service name"):
            subjects.collective_subjects(bad)
    with pytest.raises(ValueError, match="illegal service name"):
        group.alive("x.>")


def test_progress_subjects_are_inboxes_of_the_requesters_tenant() -> None:
    assert progress_inbox_prefix() == "_INBOX."
    assert progress_inbox_prefix("acme") == "_INBOX_acme."
    for good, tenant in (
        ("_INBOX.Tq3Xw2cX8mLh0cV5q1Yz7A", "default"),
        ("_INBOX.Tq3Xw2cX8mLh0cV5q1Yz7A.progress", "default"),
        ("_INBOX_acme.Tq3Xw2cX8mLh0cV5q1Yz7A", "acme"),
    ):
        assert check_progress_subject(good, tenant) == good
    for bad, tenant in (
        ("plexrl.runs.submit", "default"),
        ("plexrl.inference.acme.generate", "acme"),
        ("_INBOX", "default"),
        ("_INBOX.", "default"),
        ("_INBOX.>", "default"),
        ("_INBOX.*", "default"),
        ("_INBOX.a..b", "default"),
        ("_INBOX.a b", "default"),
        ("_INBOX.a\n", "default"),
        ("_INBOXES.a", "default"),
        # a tenant names only its own inboxes, and the default tenant none of a tenant's
        ("_INBOX.Tq3Xw2cX8mLh0cV5q1Yz7A", "acme"),
        ("_INBOX_beta.Tq3Xw2cX8mLh0cV5q1Yz7A", "acme"),
        ("_INBOX_acme.Tq3Xw2cX8mLh0cV5q1Yz7A", "default"),
    ):
        with pytest.raises(ValueError, match="a replica publishes progress only to an inbox"):
            check_progress_subject(bad, tenant)
