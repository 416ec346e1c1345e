"""Encoding and decoding of events: JSON (canonical) and MessagePack.

Decoders are built once per target type and reused; ``decode`` raises :class:`DecodeError`, with
a message that says what was wrong (msgspec's path-qualified validation errors), for every
payload it cannot read. That includes the payloads on which msgspec raises something else: a
string that is not UTF-8 (UnicodeDecodeError) and nesting deeper than the interpreter's
recursion limit (RecursionError; a few kilobytes of ``[`` are enough).
"""

from __future__ import annotations

import functools
from typing import Any, Literal, TypeVar, cast

import msgspec

from schemas.events import AnyEvent

JSON = "application/json"
MSGPACK = "application/msgpack"
Format = Literal["json", "msgpack"]

T = TypeVar("T")

_json_encoder = msgspec.json.Encoder()
_msgpack_encoder = msgspec.msgpack.Encoder()


class DecodeError(ValueError):
    """A payload that is not a valid event of the expected type."""


def content_type(fmt: Format) -> str:
    return MSGPACK if fmt == "msgpack" else JSON


def encode(event: msgspec.Struct, fmt: Format = "json") -> bytes:
    """Encode ``event`` as JSON (the default) or MessagePack."""
    if fmt == "msgpack":
        return _msgpack_encoder.encode(event)
    return _json_encoder.encode(event)


@functools.cache
def _json_decoder(target: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(target)


@functools.cache
def _msgpack_decoder(target: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(target)


def is_msgpack(content_type_header: str | None) -> bool:
    if not content_type_header:
        return False
    return content_type_header.split(";")[0].strip().lower() in (
        MSGPACK,
        "application/x-msgpack",
        "application/vnd.msgpack",
    )


def decode(
    data: bytes, target: type[T] | Any = AnyEvent, content_type_header: str | None = None
) -> T:
    """Decode ``data`` into ``target`` (an event class or a union of them).

    ``content_type_header`` selects MessagePack when it says so; anything else is JSON.
    """
    try:
        if is_msgpack(content_type_header):
            return cast(T, _msgpack_decoder(cast(Any, target)).decode(data))
        return cast(T, _json_decoder(cast(Any, target)).decode(data))
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise DecodeError(str(exc)) from exc
    except UnicodeDecodeError as exc:
        raise DecodeError(f"a string in the payload is not UTF-8: {exc}") from None
    except RecursionError:
        raise DecodeError("the payload nests arrays or objects too deeply to decode") from None


def salvage_id(data: bytes, field: str = "request_id") -> str:
    """The string ``field`` (a request id, a run id) of a payload that did not validate, if one
    can be read; else ""."""
    unreadable = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
    try:
        raw = msgspec.json.decode(data)
    except unreadable:
        try:
            raw = msgspec.msgpack.decode(data)
        except unreadable:
            return ""
    value = raw.get(field) if isinstance(raw, dict) else None
    if isinstance(value, str) and 0 < len(value) <= 256:
        return value
    return ""
