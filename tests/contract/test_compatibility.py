"""Schema evolution: readers tolerate fields they do not know and reject types they do not know,
and every version's valid examples still decode (see test_examples.py)."""

from __future__ import annotations

import json

import pytest

from schemas.codec import MSGPACK, DecodeError, decode, encode
from schemas.events import SUPPORTED_VERSIONS, AnyEvent, RolloutBatch, WeightsReady

from .vectors import CURRENT_DIR, EVENTS, examples, validator, version_dirs


def _with(path: str, **extra: object) -> dict[str, object]:
    return {**json.loads((CURRENT_DIR / path).read_text()), **extra}


@pytest.mark.parametrize("target", [WeightsReady, AnyEvent], ids=["class", "union"])
def test_an_unknown_field_is_ignored(target: object) -> None:
    doc = _with("weights_ready/valid_1.json", compression="zstd", shard={"index": 0, "of": 2})
    event: object = decode(json.dumps(doc).encode(), target)
    assert isinstance(event, WeightsReady)
    assert event.step == 13
    assert "compression" not in json.loads(encode(event))
    assert list(validator("weights_ready").iter_errors(doc)) == []


def test_an_unknown_nested_field_is_ignored_in_messagepack_too() -> None:
    doc = _with("rollout_batch/valid_1.json")
    doc["samples"][0]["ref_logprobs"] = [-0.1, -0.2]  # type: ignore[index]
    event: RolloutBatch = decode(json.dumps(doc).encode(), RolloutBatch)
    assert event.samples[0].reward == 1.0
    packed = encode(event, "msgpack")
    assert decode(packed, AnyEvent, content_type_header=MSGPACK) == event


@pytest.mark.parametrize("tag", ["run_started", "RunSubmitted", "", "weights-ready"])
def test_an_unknown_type_is_rejected_naming_the_type_field(tag: str) -> None:
    doc = _with("run_forgotten/valid_1.json", type=tag)
    with pytest.raises(DecodeError) as info:
        decode(json.dumps(doc).encode(), AnyEvent)
    assert "`$.type`" in str(info.value)
    assert repr(tag) in str(info.value)


def test_a_message_without_a_type_is_rejected_by_the_union() -> None:
    doc = _with("run_forgotten/valid_1.json")
    del doc["type"]
    with pytest.raises(DecodeError, match="missing required field `type`"):
        decode(json.dumps(doc).encode(), AnyEvent)
    assert [e.validator for e in validator("run_forgotten").iter_errors(doc)] == ["required"]


def test_every_example_version_is_supported_and_has_every_event_then_known() -> None:
    versions = [v for v, _ in version_dirs()]
    assert versions[0] == 1
    assert versions == sorted(set(versions))
    assert set(versions) <= set(SUPPORTED_VERSIONS)
    for version, vdir in version_dirs():
        tags = {p.name for p in vdir.iterdir() if p.is_dir()}
        assert tags <= set(EVENTS), f"v{version} has examples of events this code does not know"
    assert len(examples("valid", all_versions=True)) >= 2 * len(EVENTS)
