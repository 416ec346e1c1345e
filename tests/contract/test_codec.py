"""The codec itself: which content types mean MessagePack, both encodings of one event, the
messages of what cannot be decoded, and the ids read back from payloads that did not validate."""

from __future__ import annotations

import msgspec
import pytest

from schemas.codec import (
    JSON,
    MSGPACK,
    DecodeError,
    content_type,
    decode,
    encode,
    is_msgpack,
    salvage_id,
)
from schemas.events import EvictRequested

EVENT = EvictRequested(run_id="run_a", reason="diverged", requested_by="trainer")


def test_content_types() -> None:
    assert (JSON, MSGPACK) == ("application/json", "application/msgpack")
    assert (content_type("json"), content_type("msgpack")) == (JSON, MSGPACK)
    for header in (
        "application/msgpack",
        "application/x-msgpack",
        "application/vnd.msgpack",
        " Application/MsgPack ; charset=binary",
        "application/vnd.msgpack;charset=binary",
    ):
        assert is_msgpack(header), header
    for header in (None, "", "application/json", "text/msgpack", "application/msgpack2"):
        assert not is_msgpack(header), header


def test_both_encodings_of_an_event_and_back() -> None:
    as_json, as_msgpack = encode(EVENT), encode(EVENT, "msgpack")
    assert as_json == msgspec.json.encode(EVENT) and as_msgpack == msgspec.msgpack.encode(EVENT)
    assert decode(as_json, EvictRequested) == EVENT
    assert decode(as_msgpack, EvictRequested, "application/x-msgpack") == EVENT
    # anything but a MessagePack content type is read as JSON
    assert decode(as_json, EvictRequested, "text/plain") == EVENT
    with pytest.raises(DecodeError):
        decode(as_msgpack, EvictRequested)


def test_what_cannot_be_decoded_says_why() -> None:
    with pytest.raises(DecodeError, match=r"^Object missing required field `reason`$"):
        decode(b'{"type": "evict_requested", "run_id": "run_a"}', EvictRequested)
    with pytest.raises(DecodeError, match=r"^a string in the payload is not UTF-8: .+"):
        decode(b'{"type": "evict_requested", "run_id": "\xff"}', EvictRequested)
    deep = b"[" * 100_000
    with pytest.raises(
        DecodeError, match=r"^the payload nests arrays or objects too deeply to decode$"
    ):
        decode(deep, list)


def test_an_id_is_salvaged_from_a_payload_that_did_not_validate() -> None:
    assert salvage_id(b'{"request_id": "req-1", "n": "x"}') == "req-1"
    assert salvage_id(msgspec.msgpack.encode({"request_id": "req-2"})) == "req-2"
    assert salvage_id(b'{"run_id": "run_a"}', "run_id") == "run_a"
    assert salvage_id(b'{"run_id": "run_a"}') == ""  # another field
    assert salvage_id(b'{"request_id": "r"}') == "r"  # one character is an id
    long = "x" * 256
    assert salvage_id(msgspec.json.encode({"request_id": long})) == long
    for unusable in (
        msgspec.json.encode({"request_id": long + "x"}),  # too long to be an id
        b'{"request_id": ""}',
        b'{"request_id": 7}',
        b'["request_id"]',
        b"\xc1",  # neither JSON nor MessagePack
        b"[" * 100_000,
    ):
        assert salvage_id(unusable) == "", unusable
