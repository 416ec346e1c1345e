"""The Tinker SDK's protobuf messages, read and written by hand.

The SDK sends ``forward_backward`` as a protobuf ``ForwardBackwardRequest`` and wants
``SampleResponse`` and ``ForwardBackwardOutput`` back as protobuf (``Accept:
application/x-protobuf``); everything else is JSON. Those three messages use four wire types
(varint, 64-bit, length-delimited, 32-bit) and a handful of fields, so the gateway codes them
itself rather than depending on the SDK's generated module and ``protobuf`` at run time. The
field numbers are those of the SDK's ``tinker_public.proto``; the tests check this codec against
the SDK's own encoder and decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROTOBUF = "application/x-protobuf"

DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
DTYPE_INT32 = 3
DTYPE_BFLOAT16 = 4
_NUMPY: dict[int, np.dtype[Any]] = {
    DTYPE_FLOAT32: np.dtype(np.float32),
    DTYPE_INT64: np.dtype(np.int64),
    DTYPE_INT32: np.dtype(np.int32),
}
STOP_REASONS = {"stop": 0, "length": 1}


class WireError(ValueError):
    """Bytes that are not the protobuf message they claim to be."""


# --- reading -----------------------------------------------------------------------------------


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("truncated varint")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field of a message: ints for varint and fixed fields,
    bytes for length-delimited ones (fixed64 and fixed32 come as their raw 8 or 4 bytes)."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise WireError(f"unsupported wire type {wire} (field {number})")
        if pos > len(data):
            raise WireError(f"field {number} runs past the end of the message")
        yield number, value


def _bytes(value: int | bytes, name: str) -> bytes:
    if not isinstance(value, bytes):
        raise WireError(f"{name} is not length-delimited")
    return value


def _text(value: int | bytes, name: str) -> str:
    try:
        return _bytes(value, name).decode()
    except UnicodeDecodeError as exc:
        raise WireError(f"{name} is not UTF-8 text") from exc


def _int32s(value: int | bytes, name: str) -> list[int]:
    raw = _bytes(value, name)
    if len(raw) % 4:
        raise WireError(f"{name}: {len(raw)} bytes are not a whole number of int32 values")
    return np.frombuffer(raw, dtype=np.int32).tolist()


def _double(value: int | bytes) -> float:
    if not isinstance(value, bytes) or len(value) != 8:
        raise WireError("a double is 8 bytes")
    return float(struct.unpack("<d", value)[0])


def _signed(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise WireError("expected a varint")
    return value - (1 << 64) if value >= 1 << 63 else value


def _map_entry(data: bytes) -> tuple[str, int | bytes | None]:
    key, value = "", None
    for number, v in fields(data):
        if number == 1:
            key = _text(v, "map key")
        elif number == 2:
            value = v
    return key, value


def tensor_values(data: bytes) -> list[float]:
    """The values of a dense ``Tensor`` message, flattened."""
    dense, dtype = b"", DTYPE_FLOAT32
    for number, v in fields(data):
        if number == 1:
            dense = _bytes(v, "Tensor.dense")
        elif number == 2:
            raise WireError("sparse tensors are not supported in loss_fn_inputs; send them dense")
        elif number == 3:
            dtype = _signed(v)
    np_dtype = _NUMPY.get(dtype)
    if np_dtype is None:
        raise WireError(f"tensor dtype {dtype} is not supported (float32, int64 or int32)")
    if len(dense) % np_dtype.itemsize:
        raise WireError("tensor bytes are not a whole number of elements")
    return np.frombuffer(dense, dtype=np_dtype).astype(np.float64).tolist()


@dataclass
class FwdBwdDatum:
    tokens: list[int] = field(default_factory=list)
    loss_fn_inputs: dict[str, list[float]] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    """What plexrl reads of a Tinker ``ForwardBackwardRequest``."""

    model_id: str = ""
    seq_id: int = 0
    data: list[FwdBwdDatum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float] = field(default_factory=dict)
    forward_only: bool = False


def _datum(data: bytes) -> FwdBwdDatum:
    datum = FwdBwdDatum()
    for number, v in fields(data):
        if number == 1:  # Chunk
            for kind, chunk in fields(_bytes(v, "Chunk")):
                if kind != 1:
                    raise WireError(
                        "only text chunks (token ids) are supported, not images or audio"
                    )
                for n, tokens in fields(_bytes(chunk, "EncodedTextChunk")):
                    if n == 1:
                        datum.tokens.extend(_int32s(tokens, "tokens"))
        elif number == 2:
            key, tensor = _map_entry(_bytes(v, "loss_fn_inputs"))
            datum.loss_fn_inputs[key] = tensor_values(_bytes(tensor or b"", key))
    return datum


def decode_forward_backward(data: bytes) -> FwdBwdRequest:
    """Read a protobuf ``ForwardBackwardRequest``; :class:`WireError` if it is not one."""
    req = FwdBwdRequest()
    for number, v in fields(data):
        if number == 1:
            req.model_id = _text(v, "model_id")
        elif number == 2:
            req.seq_id = _signed(v)
        elif number == 3:
            req.data.append(_datum(_bytes(v, "Datum")))
        elif number == 4:
            req.loss_fn = _text(v, "loss_fn")
        elif number == 5:
            key, value = _map_entry(_bytes(v, "loss_fn_config"))
            req.loss_fn_config[key] = _double(value or b"\0" * 8)
        elif number == 6:
            req.forward_only = bool(v)
        elif number == 7:
            key, value = _map_entry(_bytes(v, "loss_fn_config_v2"))
            for n, x in fields(_bytes(value or b"", key)):
                if n == 1:
                    req.loss_fn_config[key] = _double(x)
                elif n == 2:
                    raise WireError(f"loss_fn_config {key!r}: text values are not supported")
    return req


# --- writing -----------------------------------------------------------------------------------


def _put_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field_varint(number: int, value: int) -> bytes:
    return _put_varint(number << 3) + _put_varint(value)


def _field_bytes(number: int, value: bytes) -> bytes:
    return _put_varint(number << 3 | 2) + _put_varint(len(value)) + value


def _field_double(number: int, value: float) -> bytes:
    return _put_varint(number << 3 | 1) + struct.pack("<d", value)


TopRows = list[list[tuple[int, float]]]
"""per position, (token id, log-probability) pairs, most likely first"""

EMPTY_TOP_LOGPROB = -99999.0
"""what an empty cell of a TopkLogprobs matrix holds (token id 0), as the SDK expects"""


@dataclass
class SampledSequence:
    """One sequence of a SampleResponse; ``top`` the alternatives at each token (None: not
    asked for)."""

    tokens: list[int]
    logprobs: list[float]
    stop: str
    top: TopRows | None = None


def _topk(rows: TopRows, k: int) -> bytes:
    """A ``TopkLogprobs`` message: dense N x k matrices, empty cells (0, -99999)."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    values = np.full((len(rows), k), EMPTY_TOP_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row[:k]):
            ids[i, j], values[i, j] = token, logprob
    out = _field_bytes(1, ids.tobytes()) + _field_bytes(2, values.tobytes())
    return out + _field_varint(3, k) + _field_varint(4, len(rows))


def encode_sample_response(
    sequences: list[SampledSequence] | list[tuple[list[int], list[float], str]],
    *,
    prompt_logprobs: list[float | None] | None = None,
    prompt_top: TopRows | None = None,
    k_prompt: int = 0,
    k_sample: int = 0,
) -> bytes:
    """A protobuf ``SampleResponse``: the sequences (with their top-``k_sample`` alternatives
    when they carry them) and, when asked for, the prompt's log-probabilities (NaN where there
    are none, as at the first token) and its top-``k_prompt`` alternatives."""
    out = bytearray()
    for item in sequences:
        seq_ = item if isinstance(item, SampledSequence) else SampledSequence(*item)
        stop = STOP_REASONS[seq_.stop]
        seq = _field_varint(1, stop) if stop else b""
        seq += _field_bytes(2, np.asarray(seq_.tokens, dtype=np.int32).tobytes())
        seq += _field_bytes(3, np.asarray(seq_.logprobs, dtype=np.float32).tobytes())
        if seq_.top is not None and k_sample:
            seq += _field_bytes(4, _topk(seq_.top, k_sample))
        out += _field_bytes(1, seq)
    if prompt_logprobs is not None:
        values = [float("nan") if v is None else v for v in prompt_logprobs]
        out += _field_bytes(2, np.asarray(values, dtype=np.float32).tobytes())
    if prompt_top is not None and k_prompt:
        out += _field_bytes(3, _topk(prompt_top, k_prompt))
    return bytes(out)


def encode_forward_backward_output(
    outputs: list[dict[str, list[float]]], metrics: dict[str, float]
) -> bytes:
    """A protobuf ``ForwardBackwardOutput``: one ArrayRecord holding every datum's float32
    outputs (``logprobs``, ``elementwise_loss``...), and the metrics."""
    out = bytearray(_field_bytes(1, b"ArrayRecord"))
    record = bytearray(_field_bytes(1, b"ArrayRecord"))
    names = sorted({name for datum in outputs for name in datum})
    for name in names:
        arrays = [np.asarray(datum.get(name, []), dtype=np.float32) for datum in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64)
        batched = _field_bytes(1, b"".join(a.tobytes() for a in arrays))
        batched += _field_bytes(2, offsets.tobytes()) + _field_varint(3, DTYPE_FLOAT32)
        entry = _field_bytes(1, name.encode()) + _field_bytes(2, batched)
        record += _field_bytes(2, entry)
    record += _field_varint(3, len(outputs))
    out += _field_bytes(2, bytes(record))
    for key, value in metrics.items():
        out += _field_bytes(3, _field_bytes(1, key.encode()) + _field_double(2, float(value)))
    return bytes(out)
