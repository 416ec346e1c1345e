"""The example messages in schemas/examples/ are test vectors: the valid ones pass the JSON
Schema and msgspec and round-trip exactly; the invalid ones fail both, with a useful message."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from schemas.codec import MSGPACK, DecodeError, decode, encode
from schemas.collective import COLLECTIVE_MESSAGES
from schemas.events import SCHEMA_VERSION, Event

from .vectors import (
    CURRENT_DIR,
    TAGS,
    Example,
    examples,
    expected_errors,
    union_of,
    validator,
)

VALID = examples("valid", all_versions=True)
VALID_CURRENT = [e for e in VALID if e.version == SCHEMA_VERSION]
INVALID = examples("invalid", all_versions=False)


def test_every_event_has_valid_and_invalid_examples() -> None:
    assert sorted(p.name for p in CURRENT_DIR.iterdir() if p.is_dir()) == TAGS
    for tag in TAGS:
        assert sum(e.tag == tag for e in VALID_CURRENT) >= 2, tag
        assert sum(e.tag == tag for e in INVALID) >= 4, tag


def test_every_invalid_example_has_an_expected_error_and_nothing_else_does() -> None:
    for tag in TAGS:
        listed = set(expected_errors(CURRENT_DIR / tag))
        assert listed == {e.path.name for e in INVALID if e.tag == tag}, tag


@pytest.mark.parametrize("example", VALID, ids=str)
def test_valid_example_passes_json_schema(example: Example) -> None:
    errors = [e.message for e in validator(example.tag).iter_errors(example.data)]
    assert errors == []


@pytest.mark.parametrize("example", VALID, ids=str)
def test_valid_example_decodes_as_its_class_and_as_any_event(example: Example) -> None:
    event: Event = decode(example.raw, example.cls)
    assert type(event) is example.cls
    assert decode(example.raw, union_of(example.cls)) == event
    if example.cls not in COLLECTIVE_MESSAGES:
        assert decode(example.raw) == event
    # Every field the example carries reaches the event with its value: this is what makes an
    # old version's example still mean the same thing today.
    encoded = json.loads(encode(event))
    for key, value in example.data.items():
        assert encoded[key] == value, key


@pytest.mark.parametrize("example", VALID_CURRENT, ids=str)
def test_valid_example_round_trips_exactly_in_canonical_order(example: Example) -> None:
    original = example.data
    again = json.loads(encode(decode(example.raw, example.cls)))
    assert again == original
    assert list(again) == list(original)
    assert again["schema_version"] == SCHEMA_VERSION


@pytest.mark.parametrize("example", VALID, ids=str)
def test_valid_example_survives_messagepack(example: Example) -> None:
    event: Event = decode(example.raw, example.cls)
    packed = encode(event, "msgpack")
    assert packed != encode(event)
    assert decode(packed, example.cls, content_type_header=MSGPACK) == event
    assert decode(packed, union_of(example.cls), content_type_header=MSGPACK) == event
    # The same object written by another language's MessagePack library decodes too.
    foreign = msgspec.msgpack.encode(_msgpack_native(example.data, example.tag))
    assert decode(foreign, example.cls, content_type_header=MSGPACK) == event


@pytest.mark.parametrize("example", INVALID, ids=str)
def test_invalid_example_fails_json_schema(example: Example) -> None:
    assert list(validator(example.tag).iter_errors(example.data)) != []


@pytest.mark.parametrize("example", INVALID, ids=str)
def test_invalid_example_fails_msgspec_with_a_useful_message(example: Example) -> None:
    wanted = expected_errors(example.path.parent)[example.path.name]
    assert wanted, "an expected error lists at least one substring"
    for target in (example.cls, union_of(example.cls)):
        with pytest.raises(DecodeError) as info:
            decode(example.raw, target)
        for fragment in wanted:
            assert fragment in str(info.value), (target, str(info.value))


def test_an_invalid_run_id_example_exists_for_each_illegal_form() -> None:
    seen = {e.data.get("run_id") for e in INVALID}
    for bad in ("run_../x", "run_a.b", "run_*", "run_a\n", "", "xrun_a", "run_a/b", "run_a b"):
        assert bad in seen, bad


def _msgpack_native(data: Any, tag: str) -> Any:
    """JSON carries bytes as base64; a MessagePack writer sends them as bin."""
    field = {"invalid_message": "leading_bytes", "checkpoints_result": "data"}.get(tag)
    if field is not None and isinstance(data, dict):
        return {**data, field: msgspec.json.decode(json.dumps(data[field]).encode(), type=bytes)}
    return data
