"""Property tests: any event the types allow survives JSON and MessagePack unchanged, and the
committed JSON Schema accepts it (the schema is no stricter than msgspec)."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.codec import MSGPACK, decode, encode
from schemas.events import ALL_EVENTS, AnyEvent, Event, RunForgotten, event_tag
from schemas.run_id import RUN_ID_PATTERN, is_valid_run_id

from .vectors import validator

INT64 = (-(2**63), 2**63 - 1)

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(*INT64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _pattern(pattern: str) -> st.SearchStrategy[str]:
    # fullmatch=True already excludes the trailing newline that the wire patterns' "(?!\n)"
    # guards against, and hypothesis cannot generate from a lookahead.
    plain = pattern.replace(r"(?!\n)", "")
    if plain == RUN_ID_PATTERN:
        return st.from_regex(RUN_ID_PATTERN, fullmatch=True)
    return st.from_regex(plain, fullmatch=True)


def strategy(t: mi.Type) -> st.SearchStrategy[Any]:
    """Values of a msgspec type, within its constraints, small enough to keep tests fast."""
    match t:
        case mi.Metadata():
            return strategy(t.type)
        case mi.StructType():
            fields = {f.name: strategy(f.type) for f in t.fields}
            return st.builds(t.cls, **fields)
        case mi.IntType():
            lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else INT64[0])
            hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else INT64[1])
            return st.integers(lo, hi)
        case mi.FloatType():
            return st.floats(
                min_value=t.ge if t.ge is not None else t.gt,
                max_value=t.le if t.le is not None else t.lt,
                exclude_min=t.gt is not None,
                exclude_max=t.lt is not None,
                allow_nan=False,
                allow_infinity=False,
            )
        case mi.StrType() if t.pattern is not None:
            return _pattern(t.pattern)
        case mi.StrType():
            return st.text(min_size=t.min_length or 0, max_size=min(t.max_length or 24, 24))
        case mi.BoolType():
            return st.booleans()
        case mi.NoneType():
            return st.none()
        case mi.BytesType():
            return st.binary(max_size=32)
        case mi.LiteralType():
            return st.sampled_from(t.values)
        case mi.ListType():
            return st.lists(strategy(t.item_type), min_size=t.min_length or 0, max_size=3)
        case mi.DictType():
            return st.dictionaries(strategy(t.key_type), strategy(t.value_type), max_size=3)
        case mi.UnionType():
            return st.one_of([strategy(u) for u in t.types])
        case mi.AnyType():
            return _json_values
    raise TypeError(f"no strategy for {t!r}: extend tests/contract/test_properties.py")


def events(cls: type[Event]) -> st.SearchStrategy[Event]:
    return strategy(mi.type_info(cls))


_settings = settings(
    max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@pytest.mark.parametrize("cls", ALL_EVENTS, ids=event_tag)
def test_any_event_round_trips_and_passes_its_json_schema(cls: type[Event]) -> None:
    check = validator(event_tag(cls))

    @_settings
    @given(events(cls))
    def round_trip(event: Event) -> None:
        as_json = encode(event)
        assert decode(as_json, cls) == event
        assert decode(as_json, AnyEvent) == event
        as_msgpack = encode(event, "msgpack")
        assert decode(as_msgpack, cls, content_type_header=MSGPACK) == event
        assert decode(as_msgpack, AnyEvent, content_type_header=MSGPACK) == event
        obj = json.loads(as_json)
        assert obj["type"] == event_tag(cls)
        assert [e.message for e in check.iter_errors(obj)] == []

    round_trip()


@_settings
@given(st.from_regex(RUN_ID_PATTERN, fullmatch=True))
def test_generated_run_ids_are_legal_everywhere(run_id: str) -> None:
    assert is_valid_run_id(run_id)
    raw = msgspec.json.encode({"type": "run_forgotten", "run_id": run_id, "idx": 0})
    assert decode(raw, RunForgotten).run_id == run_id
