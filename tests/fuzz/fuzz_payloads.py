"""What the fuzz tests throw at the services: garbage bytes, random JSON and MessagePack
documents, valid events mutated a few steps at a time, payloads nested too deeply to decode,
each with a content type and trace headers, on a subject a service consumes.

Every strategy is plain Hypothesis, so a failing payload shrinks to a small one; the oracle that
says whether a payload is an event at all is the codec the services use (:func:`decodes`).
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from schemas import subjects as sj
from schemas.codec import JSON, MSGPACK, decode
from schemas.config import ConfigError, orch_config_from_dict
from schemas.events import ALL_EVENTS, RunDiscovered, RunEvicted, RunForgotten, event_tag


def fuzz(examples: int) -> settings:
    """The profile of every fuzz test: the same ``examples`` on every run
    (``PLEXRL_FUZZ_EXAMPLES`` searches longer, still deterministically), no time limit per
    example (each one waits for the services)."""
    return settings(
        derandomize=True,
        database=None,
        deadline=None,
        max_examples=int(os.environ.get("PLEXRL_FUZZ_EXAMPLES", examples)),
        # One service started per test serves every example: sharing it is the point.
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@dataclass(frozen=True)
class Wire:
    """One message as it goes on the bus."""

    subject: str
    data: bytes
    content_type: str | None = JSON
    trace: tuple[tuple[str, str], ...] = ()
    """trace headers (``traceparent``...), garbage more often than not"""

    @property
    def headers(self) -> dict[str, str] | None:
        headers = dict(self.trace)
        if self.content_type is not None:
            headers["Content-Type"] = self.content_type
        return headers or None


@dataclass(frozen=True)
class Thrown:
    """A payload meant for one of a service's decoders (``target``); a request is sent without
    a reply subject when ``with_reply`` is False."""

    target: str
    wire: Wire
    with_reply: bool = True


def decodes(wire: Wire, event_type: Any) -> Any | None:
    """The event ``wire`` carries, as the services decode it, or None if it carries none."""
    try:
        return decode(wire.data, event_type, wire.content_type)
    except Exception:  # the services must reject every payload the codec cannot read
        return None


CONTENT_TYPES = [
    None,
    JSON,
    MSGPACK,
    "application/x-msgpack",
    "application/vnd.msgpack",
    "application/msgpack; charset=binary",
    "text/plain",
]

TAGS = [event_tag(e) for e in ALL_EVENTS]

INT64 = (-(2**63), 2**63 - 1)
UINT64_MAX = 2**64 - 1

# Values at the edges of what the schemas allow: bounds, types msgspec tells apart, strings
# that look like run ids but are not.
_EDGE: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    4095,
    4096,
    2**31,
    2**53 + 1,
    INT64[1],
    INT64[0],
    UINT64_MAX,
    0.5,
    -0.0,
    1e308,
    -1e308,
    5e-324,
    "",
    " ",
    "0",
    "run_",
    "run_a\n",
    "run_../../etc",
    "run_a.b",
    "run_*",
    "run_" + "x" * 65,
    "default",
    "\x00",
    "ä",
    "sha256:" + "0" * 64,
    "x" * 5000,
    [],
    {},
    [[]],
    [None],
    {"": None},
]

_text = st.text(max_size=12)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(*INT64)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text
    | st.sampled_from(_EDGE)
)

json_values = st.recursive(
    _scalars | st.integers(min_value=-(2**70), max_value=2**70),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
"""Any JSON document (integers past 64 bits included)."""

_msgpack_scalars = (
    _scalars
    | st.integers(INT64[0], UINT64_MAX)
    | st.floats()  # NaN and infinities: MessagePack carries them, JSON cannot
    | st.binary(max_size=16)
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=8))
    | st.datetimes(timezones=st.just(datetime.UTC))
)

msgpack_values = st.recursive(
    _msgpack_scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_text, inner, max_size=4)
        # maps whose keys are no strings
        | st.dictionaries(st.integers(-5, 5) | st.binary(max_size=3) | st.none(), inner, max_size=3)
    ),
    max_leaves=12,
)
"""Any MessagePack document (binary, extension types, timestamps, NaN, non-string keys)."""


def _json_bytes(value: Any, *, ascii_only: bool = True) -> bytes:
    # The standard library writes NaN, Infinity and big integers; no JSON decoder takes the first
    # two, which is what makes them worth sending.
    return json.dumps(value, allow_nan=True, ensure_ascii=ascii_only).encode()


def _encode(value: Any, fmt: str) -> bytes:
    if fmt == "msgpack":
        return msgspec.msgpack.encode(value)
    return _json_bytes(value, ascii_only=False)


def _fits_json(value: Any) -> bool:
    """Whether the standard library can write ``value`` as JSON."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        return False
    return True


# --- mutations of a valid event -------------------------------------------------------------

Path = tuple[Any, ...]


def _paths(tree: Any, here: Path = ()) -> list[Path]:
    out = [here]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*here, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, (*here, i))
    return out


def _get(tree: Any, path: Path) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    _get(tree, path[:-1])[path[-1]] = value
    return tree


def _delete(tree: Any, path: Path) -> Any:
    if not path:
        return {}
    parent = _get(tree, path[:-1])
    del parent[path[-1]]
    return tree


@st.composite
def _mutate(draw: st.DrawFn, tree: Any, fmt: str) -> Any:
    """``tree`` changed in one place: a value replaced, removed, wrapped or retagged, or a key
    added."""
    tree = copy.deepcopy(tree)
    path = draw(st.sampled_from(_paths(tree)))
    values = msgpack_values if fmt == "msgpack" else json_values
    op = draw(st.sampled_from(["replace", "edge", "drop", "wrap", "retag", "add", "scale"]))
    match op:
        case "replace":
            return _set(tree, path, draw(values))
        case "edge":
            return _set(tree, path, draw(st.sampled_from(_EDGE)))
        case "drop":
            return _delete(tree, path)
        case "wrap":
            old = _get(tree, path)
            return _set(tree, path, draw(st.sampled_from([[old], {"value": old}, str(old)])))
        case "retag" if isinstance(tree, dict):
            tree["type"] = draw(st.sampled_from(TAGS) | _text)
            return tree
        case "add":
            target = _get(tree, path)
            if isinstance(target, dict):
                target[draw(_text)] = draw(values)
            elif isinstance(target, list):
                target.append(draw(values))
            return tree
        case "scale":
            old = _get(tree, path)
            if isinstance(old, int | float) and not isinstance(old, bool):
                factor = draw(st.sampled_from([-1, 2**40, 2**70, 1e300, math.nan, math.inf]))
                new = old * factor if old else factor
                if fmt == "msgpack" and isinstance(new, int) and not INT64[0] <= new <= UINT64_MAX:
                    new = float(new)
                return _set(tree, path, new)
            return tree
    return tree


@st.composite
def _corrupt(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with its bytes damaged: cut short, a byte changed, inserted or appended."""
    op = draw(st.sampled_from(["truncate", "flip", "insert", "append", "bom"]))
    if op == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if op == "bom":
        return b"\xef\xbb\xbf" + data
    if op == "append":
        return data + draw(st.binary(min_size=1, max_size=8))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    byte = draw(st.integers(0, 255))
    if op == "flip" and data:
        return data[:at] + bytes([data[at] ^ (byte or 1)]) + data[at + 1 :]
    return data[:at] + bytes([byte]) + data[at:]


def _deep(depth: int, form: str) -> bytes:
    match form:
        case "json-array":
            return b"[" * depth + b"]" * depth
        case "json-object":
            return b'{"a":' * depth + b"1" + b"}" * depth
        case "msgpack-array":
            return b"\x91" * depth + b"\xc0"
        case _:
            return b"\x81\xa1a" * depth + b"\xc0"


@st.composite
def deep_payloads(draw: st.DrawFn, valid: msgspec.Struct) -> tuple[bytes, str | None]:
    """Arrays or objects nested past the interpreter's recursion limit, alone or under an
    unknown field of a valid event (a decoder skips unknown fields by walking them)."""
    depth = draw(st.integers(1_100, 4_000))
    form = draw(st.sampled_from(["json-array", "json-object", "msgpack-array", "msgpack-map"]))
    nested = _deep(depth, form)
    if draw(st.booleans()):
        return nested, MSGPACK if form.startswith("msgpack") else JSON
    if form.startswith("json"):
        body = msgspec.json.encode(valid)
        return body[:-1] + b',"zz":' + nested + b"}", JSON
    fields = msgspec.to_builtins(valid)
    head = msgspec.msgpack.encode(fields)
    # a map of n + 1 entries: the event's n, then "zz" -> the nested value
    n = len(fields)
    prefix = bytes([0x80 | (n + 1)]) if n + 1 < 16 else b"\xde" + (n + 1).to_bytes(2, "big")
    skip = 1 if n < 16 else 3
    return prefix + head[skip:] + b"\xa2zz" + nested, MSGPACK


@st.composite
def mutated(draw: st.DrawFn, valid: msgspec.Struct) -> tuple[bytes, str | None]:
    """``valid`` mutated one to three times, encoded as JSON or MessagePack, sometimes with its
    bytes damaged or labelled with the other encoding."""
    fmt = draw(st.sampled_from(["json", "msgpack"]))
    tree: Any = msgspec.to_builtins(valid)
    for _ in range(draw(st.integers(1, 3))):
        tree = draw(_mutate(tree, fmt))
    if fmt == "json" and not _fits_json(tree):
        fmt = "msgpack"
    try:
        data = _encode(tree, fmt)
    except (OverflowError, TypeError, ValueError):
        data = _json_bytes(msgspec.to_builtins(valid))
        fmt = "json"
    if draw(st.integers(0, 3)) == 0:
        data = draw(_corrupt(data))
    content_type = MSGPACK if fmt == "msgpack" else draw(st.sampled_from([JSON, None]))
    if draw(st.integers(0, 5)) == 0:  # labelled with the other encoding
        content_type = JSON if fmt == "msgpack" else MSGPACK
    return data, content_type


@st.composite
def garbage(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """Bytes that are no event: random bytes, random documents, empty and blank bodies."""
    kind = draw(st.sampled_from(["bytes", "json", "msgpack", "blank"]))
    content_type = draw(st.sampled_from(CONTENT_TYPES))
    if kind == "bytes":
        return draw(st.binary(max_size=64)), content_type
    if kind == "json":
        return _json_bytes(draw(json_values)), draw(st.sampled_from([JSON, None]))
    if kind == "msgpack":
        return msgspec.msgpack.encode(draw(msgpack_values)), MSGPACK
    return draw(st.sampled_from([b"", b" ", b"\n", b"null", b"{}", b"[]", b"\xc0"])), content_type


def payloads(valid: msgspec.Struct) -> st.SearchStrategy[tuple[bytes, str | None]]:
    """Everything above, around one valid event of the subject's type; the valid event itself
    now and then, in both encodings."""
    itself = st.sampled_from(
        [(msgspec.json.encode(valid), JSON), (msgspec.msgpack.encode(valid), MSGPACK)]
    )
    return st.one_of(mutated(valid), mutated(valid), garbage(), deep_payloads(valid), itself)


# --- subjects -------------------------------------------------------------------------------

_TOKEN_CHARS = st.characters(
    codec="utf-8",
    exclude_characters=". *>\t\r\n\x00",
    exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp"),
)
tokens = st.text(_TOKEN_CHARS, min_size=1, max_size=12) | st.sampled_from(
    ["run_a", "run_", "default", "acme", "run_x-1", "a-b_c", "ä", "$JS"]
)
"""Subject tokens: legal run ids and tenant names, and tokens that are neither."""


_header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)
_trace_headers = st.lists(
    st.tuples(st.sampled_from(["traceparent", "tracestate", "baggage"]), _header_values),
    max_size=3,
    unique_by=lambda kv: kv[0],
).map(tuple) | st.just(
    (("traceparent", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"),)  # a valid one
)


def wires(subject: st.SearchStrategy[str], valid: msgspec.Struct) -> st.SearchStrategy[Wire]:
    """Payloads around ``valid`` (see :func:`payloads`) on ``subject``, with trace headers."""
    return st.builds(
        lambda s, p, t: Wire(s, p[0], p[1], t), subject, payloads(valid), _trace_headers
    )


def tenant_ok(subject: str) -> bool:
    """Whether ``subject`` names a tenant, as a service reads it from a request's subject."""
    try:
        sj.tenant_of_subject(subject)
    except ValueError:
        return False
    return True


# --- lifecycle events, as a run mirror sees them -------------------------------------------

MIRRORED = RunDiscovered | RunEvicted | RunForgotten
MIRRORED_SUBJECTS = [
    sj.runs_subject(kind, tenant)
    for kind in ("discovered", "evicted", "forgotten")
    for tenant in ("default", "acme")
]
"""What a run mirror decodes (it skips ``plexrl.runs[.<tenant>].invalid``, the orchestrators')."""


def mirror_rejects(wire: Wire) -> bool:
    """Whether a run mirror (trainer, inference) must skip and report ``wire``: no lifecycle
    event, one whose tenant is not its subject's, or a RunDiscovered whose config no run can
    use."""
    event = decodes(wire, MIRRORED)
    if event is None or event.tenant != sj.tenant_of_subject(wire.subject):
        return True
    if isinstance(event, RunDiscovered):
        try:
            orch_config_from_dict(event.config)
        except ConfigError:
            return True
    return False


def lifecycle_rejects(run_id: str, config: dict[str, Any]) -> st.SearchStrategy[Wire]:
    """Lifecycle payloads about ``run_id`` that a run mirror must reject. Only those: a valid
    event is the registry's word, and fuzzing it would move the service's runs around."""
    subject = st.sampled_from(MIRRORED_SUBJECTS)
    return st.one_of(
        wires(subject, RunDiscovered(run_id=run_id, idx=1, config=config)),
        wires(subject, RunEvicted(run_id=run_id, idx=1, reason="fuzz")),
        wires(subject, RunForgotten(run_id=run_id, idx=1)),
    ).filter(mirror_rejects)
