"""The run-id rule holds at every gate: the Python check, msgspec decoding, the JSON Schema and
subject construction all accept and reject the same strings."""

from __future__ import annotations

import msgspec
import pytest

from schemas import subjects
from schemas.codec import DecodeError, decode
from schemas.events import RunForgotten
from schemas.run_id import InvalidRunId, is_valid_run_id, validate_run_id

from .vectors import validator

LEGAL = [
    "run_a",
    "run_abc123",
    "run_ABC-def_01",
    "run__",
    "run_-",
    "run_" + "a" * 64,
    "run_reverse-lr5e-4_seed7",
]
ILLEGAL = [
    "run_../x",
    "run_a.b",
    "run_*",
    "run_>",
    "",
    "run_",
    "run_" + "a" * 65,
    "run_" + "a" * 200,
    "run_a b",
    "xrun_a",
    "Run_a",
    "run_a/b",
    "run_a\\b",
    "run_a\n",
    "\nrun_a",
    "run_a\r",
    "run_é",
    "run_a\x00",
]


def _forgotten(run_id: str) -> bytes:
    return msgspec.json.encode({"type": "run_forgotten", "run_id": run_id, "idx": 1})


@pytest.mark.parametrize("run_id", LEGAL)
def test_legal_run_id_passes_every_gate(run_id: str) -> None:
    assert is_valid_run_id(run_id)
    assert validate_run_id(run_id) == run_id
    assert decode(_forgotten(run_id), RunForgotten).run_id == run_id
    assert (
        list(
            validator("run_forgotten").iter_errors(
                {"type": "run_forgotten", "run_id": run_id, "idx": 1}
            )
        )
        == []
    )
    assert subjects.rollouts_subject(run_id) == f"plexrl.rollouts.{run_id}"
    assert subjects.weights_subject(run_id) == f"plexrl.weights.{run_id}"


@pytest.mark.parametrize("run_id", ILLEGAL, ids=repr)
def test_illegal_run_id_is_rejected_by_every_gate(run_id: str) -> None:
    assert not is_valid_run_id(run_id)
    with pytest.raises(InvalidRunId, match="illegal run id"):
        validate_run_id(run_id)
    with pytest.raises(DecodeError, match=r"- at `\$\.run_id`"):
        decode(_forgotten(run_id), RunForgotten)
    doc = {"type": "run_forgotten", "run_id": run_id, "idx": 1}
    assert [e.validator for e in validator("run_forgotten").iter_errors(doc)] == ["pattern"]
    for make in (subjects.rollouts_subject, subjects.weights_subject):
        with pytest.raises(InvalidRunId):
            make(run_id)


@pytest.mark.parametrize("value", [None, 7, b"run_a", ["run_a"]], ids=repr)
def test_non_strings_are_not_run_ids(value: object) -> None:
    assert not is_valid_run_id(value)
    with pytest.raises(InvalidRunId):
        validate_run_id(value)


def test_a_long_illegal_run_id_is_shortened_in_the_message() -> None:
    with pytest.raises(InvalidRunId) as info:
        validate_run_id("run_" + "a" * 200)
    assert "..." in str(info.value)
    assert len(str(info.value)) < 200
