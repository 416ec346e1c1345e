"""The KV records (schemas/records.py) are contract data like events: their examples in
schemas/examples/records/ pass or fail both the JSON Schema and msgspec, and what today's
writers put in the buckets reads back unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from schemas.codec import DecodeError, decode, encode
from schemas.records import ALL_RECORDS, RECORD_BUCKETS, RUN_STATUSES, Progress, RunRecord

from .vectors import EXAMPLES_DIR, committed_schema, expected_errors, validator

RECORDS_DIR = EXAMPLES_DIR / "records"
VALID = sorted(RECORDS_DIR.glob("*/valid_*.json"))
INVALID = sorted(RECORDS_DIR.glob("*/invalid_*.json"))


def _id(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def test_every_record_has_examples_and_expected_errors() -> None:
    assert sorted(p.name for p in RECORDS_DIR.iterdir()) == sorted(ALL_RECORDS)
    assert set(RECORD_BUCKETS) == set(ALL_RECORDS)
    for name in ALL_RECORDS:
        assert sum(p.parent.name == name for p in VALID) >= 2, name
        assert sum(p.parent.name == name for p in INVALID) >= 4, name
        listed = set(expected_errors(RECORDS_DIR / name))
        assert listed == {p.name for p in INVALID if p.parent.name == name}, name


@pytest.mark.parametrize("path", VALID, ids=_id)
def test_valid_record_passes_schema_and_round_trips_in_order(path: Path) -> None:
    name, data = path.parent.name, json.loads(path.read_bytes())
    assert [e.message for e in validator(name).iter_errors(data)] == []
    record: msgspec.Struct = decode(path.read_bytes(), ALL_RECORDS[name])
    again = json.loads(encode(record))
    assert again == data and list(again) == list(data)


@pytest.mark.parametrize("path", INVALID, ids=_id)
def test_invalid_record_fails_schema_and_msgspec_with_a_useful_message(path: Path) -> None:
    name, data = path.parent.name, json.loads(path.read_bytes())
    assert list(validator(name).iter_errors(data)) != []
    with pytest.raises(DecodeError) as info:
        decode(path.read_bytes(), ALL_RECORDS[name])
    for part in expected_errors(RECORDS_DIR / name)[path.name]:
        assert part in str(info.value)


@pytest.mark.parametrize("name", sorted(ALL_RECORDS))
def test_record_schema_is_untagged_and_tolerates_unknown_fields(name: str) -> None:
    schema = committed_schema(name)
    assert schema["additionalProperties"] is True and "type" not in schema["properties"]
    assert schema["$id"] == f"urn:plexrl:records:{name}"


def test_unknown_fields_are_ignored_and_statuses_are_the_schema_enum() -> None:
    raw = b'{"run_id": "run_a", "status": "waiting", "added_later": [1, 2]}'
    assert decode(raw, RunRecord) == RunRecord(run_id="run_a", status="waiting")
    assert sorted(committed_schema("run_record")["properties"]["status"]["enum"]) == sorted(
        RUN_STATUSES
    )


def test_progress_keeps_the_wire_form_of_the_old_dataclass() -> None:
    # What Progress.to_json() wrote before the record moved to schemas/: json.dumps(asdict()).
    old = b'{"step":12,"total_tokens":4096,"total_samples":768,"updated_at":1718000000.0,"reward_mean":null}'
    progress: Progress = decode(old, Progress)
    assert progress == Progress(
        step=12, total_tokens=4096, total_samples=768, updated_at=1718000000.0
    )
    # written again, it gains only the tenant field added since (at the end, with its default)
    assert encode(progress) == old[:-1] + b',"tenant":"default"}'
    assert msgspec.json.decode(encode(progress)) == json.loads(old) | {"tenant": "default"}
