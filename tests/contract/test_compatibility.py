"""Schema evolution: readers tolerate fields they do not know and reject types they do not know,
and every version's valid examples still decode (see test_examples.py)."""

from __future__ import annotations

import json

import msgspec
import pytest

from schemas.codec import MSGPACK, DecodeError, decode, encode
from schemas.events import (
    SUPPORTED_VERSIONS,
    AnyEvent,
    EvictRequested,
    GenerateRequest,
    GenerateResponse,
    RolloutBatch,
    RunDiscovered,
    RunList,
    WeightsReady,
)
from schemas.records import Progress, RunRecord
from schemas.training import LoadWeightsRequest, SaveWeightsRequest

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


# --- tenants -----------------------------------------------------------------------------------

TENANT_EVENTS = ("run_discovered", "run_config_invalid", "run_evicted", "run_forgotten")


@pytest.mark.parametrize("tag", TENANT_EVENTS)
def test_a_message_written_before_tenants_existed_belongs_to_the_default_tenant(tag: str) -> None:
    found = 0
    for example in examples("valid", all_versions=True):
        if example.tag != tag or example.data.get("tenant") != "default":
            continue
        doc = example.data
        del doc["tenant"]  # what a publisher wrote before the field existed
        raw = json.dumps(doc).encode()
        event = decode(raw, AnyEvent)
        assert event.tenant == "default"  # type: ignore[union-attr]
        assert event == decode(example.raw, EVENTS[tag])
        assert list(validator(tag).iter_errors(doc)) == []
        found += 1
    assert found >= 2


def test_a_run_record_and_progress_written_before_tenants_belong_to_the_default_tenant() -> None:
    old_record = b'{"run_id":"run_a","status":"active","idx":2,"config_digest":"","transition":3}'
    record = decode(old_record, RunRecord)
    assert (record.tenant, record.idx, record.transition) == ("default", 2, 3)
    progress = decode(b'{"step":3,"total_tokens":10,"total_samples":4}', Progress)
    assert (progress.tenant, progress.step) == ("default", 3)


def test_a_tenant_run_keeps_its_tenant_through_both_encodings() -> None:
    doc = json.loads((CURRENT_DIR / "run_discovered" / "valid_3.json").read_text())
    assert doc["tenant"] == "team-a"
    event = decode(json.dumps(doc).encode(), AnyEvent)
    assert isinstance(event, RunDiscovered) and event.tenant == "team-a"
    assert decode(encode(event, "msgpack"), AnyEvent, content_type_header=MSGPACK) == event


# --- generate progress -------------------------------------------------------------------------


def test_a_generate_request_written_before_progress_existed_asks_for_none() -> None:
    doc = _with("generate_request/valid_2.json")
    assert doc["progress_subject"] is not None
    del doc["progress_subject"], doc["progress_every_s"]  # what an old client sends
    raw = json.dumps(doc).encode()
    for target in (GenerateRequest, AnyEvent):
        event = decode(raw, target)
        assert isinstance(event, GenerateRequest)
        assert (event.progress_subject, event.progress_every_s) == (None, 2.0)
        assert (event.request_id, event.seed, event.timeout_s) == (doc["request_id"], 1234, 120.0)
    assert list(validator("generate_request").iter_errors(doc)) == []


def test_a_reader_without_the_progress_fields_still_reads_a_new_request() -> None:
    """An old replica's GenerateRequest had no progress fields: it ignores them."""

    class OldGenerateRequest(
        msgspec.Struct, frozen=True, kw_only=True, tag="generate_request", tag_field="type"
    ):
        request_id: str
        run_id: str
        prompts: list[list[int]]
        n: int = 1
        timeout_s: float = 30.0

    new = decode((CURRENT_DIR / "generate_request" / "valid_2.json").read_bytes(), GenerateRequest)
    assert new.progress_subject == "_INBOX.Tq3Xw2cX8mLh0cV5q1Yz7A"
    for fmt in ("json", "msgpack"):
        raw = encode(new, fmt)  # type: ignore[arg-type]
        header = MSGPACK if fmt == "msgpack" else None
        old = decode(raw, OldGenerateRequest, content_type_header=header)
        assert (old.request_id, old.prompts, old.n) == (new.request_id, new.prompts, 2)


def test_an_evict_request_from_before_delete_existed_only_evicts() -> None:
    old = b'{"type":"evict_requested","schema_version":1,"run_id":"run_a","reason":"done"}'
    event = decode(old, AnyEvent)
    assert isinstance(event, EvictRequested) and event.delete is False
    assert decode(old, EvictRequested).reason == "done"


# --- prompt logprobs, snapshots, forks (fields added with defaults) ------------------------------


def test_a_generate_request_from_before_prompt_scores_asks_for_the_old_behaviour() -> None:
    old = (
        b'{"type":"generate_request","schema_version":1,"request_id":"r1","run_id":"run_a",'
        b'"prompts":[[1,2]],"n":2,"max_tokens":4,"min_policy_version":3}'
    )
    event = decode(old, AnyEvent)
    assert isinstance(event, GenerateRequest)
    assert (event.prompt_logprobs, event.top_logprobs, event.top_k) == (False, 0, 0)
    assert (event.ignore_eos, event.exact_version, event.base_model) == (False, False, False)
    assert event.min_policy_version == 3


def test_a_generate_response_from_before_prompt_scores_decodes_with_none() -> None:
    old = (
        b'{"type":"generate_response","schema_version":1,"request_id":"r1","run_id":"run_a",'
        b'"policy_version":2,"completions":[[{"token_ids":[5],"logprobs":[-0.5],'
        b'"finish_reason":"length"}]],"error":null}'
    )
    event = decode(old, GenerateResponse)
    assert event.prompt_logprobs == []
    assert event.completions[0][0].top_logprobs == []
    assert event.completions[0][0].logprobs == [-0.5]


class OldCompletion(msgspec.Struct, frozen=True, kw_only=True):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


def test_an_old_reader_reads_a_response_with_prompt_scores() -> None:
    """A requester built before the fields existed ignores them."""

    class OldGenerateResponse(
        msgspec.Struct, frozen=True, kw_only=True, tag="generate_response", tag_field="type"
    ):
        request_id: str
        policy_version: int
        completions: list[list[OldCompletion]]

    new = decode((CURRENT_DIR / "generate_response" / "valid_3.json").read_bytes(), AnyEvent)
    assert isinstance(new, GenerateResponse) and new.prompt_logprobs[0].logprobs[0] is None
    for fmt in ("json", "msgpack"):
        header = MSGPACK if fmt == "msgpack" else None
        old = decode(encode(new, fmt), OldGenerateResponse, content_type_header=header)  # type: ignore[arg-type]
        assert old.completions[0][0].token_ids == [17]


def test_save_and_load_requests_from_before_forks_keep_their_meaning() -> None:
    save = decode(
        b'{"type":"save_weights_request","request_id":"s","run_id":"run_a","kind":"state",'
        b'"name":"x"}',
        AnyEvent,
    )
    assert isinstance(save, SaveWeightsRequest) and save.overwrite is True
    load = decode(
        b'{"type":"load_weights_request","request_id":"l","run_id":"run_a","path":"x"}', AnyEvent
    )
    assert isinstance(load, LoadWeightsRequest)
    assert (load.source_run_id, load.optimizer) == (None, True)


def test_a_run_row_from_before_labels_has_none() -> None:
    old = b'{"type":"run_list","runs":[{"run_id":"run_a","status":"active","idx":0}]}'
    listed = decode(old, RunList)
    assert listed.runs[0].labels == {}


# --- load: deadlines, request classes, overload (fields added with defaults) ---------------------


def test_a_generate_request_from_before_deadlines_has_none_and_counts_as_a_rollout() -> None:
    """An old message came from an orchestrator or from a gateway that knew no bound: it is
    served as a rollout (never refused, never slowed by the HTTP share) with no deadline."""
    doc = _with("generate_request/valid_4.json")
    assert (doc["source"], doc["deadline"]) == ("http", 1780000120.5)
    del doc["source"], doc["deadline"]
    for target in (GenerateRequest, AnyEvent):
        event = decode(json.dumps(doc).encode(), target)
        assert isinstance(event, GenerateRequest)
        assert (event.source, event.deadline, event.timeout_s) == ("rollout", None, 120.0)
    assert list(validator("generate_request").iter_errors(doc)) == []


def test_a_generate_response_from_before_error_codes_is_a_plain_error() -> None:
    doc = _with("generate_response/valid_4.json")
    assert (doc["error_code"], doc["retry_after_s"]) == ("overloaded", 1.0)
    del doc["error_code"], doc["retry_after_s"]
    event = decode(json.dumps(doc).encode(), GenerateResponse)
    assert (event.error_code, event.retry_after_s) == (None, None)
    assert event.error is not None and "max_http_requests" in event.error


def test_an_old_reader_reads_an_overloaded_response_as_its_error_text() -> None:
    class OldGenerateResponse(
        msgspec.Struct, frozen=True, kw_only=True, tag="generate_response", tag_field="type"
    ):
        request_id: str
        completions: list[list[OldCompletion]]
        error: str | None = None

    new = decode((CURRENT_DIR / "generate_response" / "valid_4.json").read_bytes(), AnyEvent)
    assert isinstance(new, GenerateResponse) and new.error_code == "overloaded"
    for fmt in ("json", "msgpack"):
        header = MSGPACK if fmt == "msgpack" else None
        old = decode(encode(new, fmt), OldGenerateResponse, content_type_header=header)  # type: ignore[arg-type]
        assert (old.completions, old.error) == ([], new.error)
