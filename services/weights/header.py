"""The safetensors header of a weight stream: its dtype codes, parsing and checking it, and
checking that a destination can take the tensors it describes (see :mod:`services.weights.stream`
for the layout).

Nothing in a header is trusted: :func:`parse_header` refuses anything that is not the header of
a well-formed safetensors file (duplicate keys, unknown dtypes, offsets that do not match the
shapes or leave gaps) before a tensor is allocated.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from services.model.lora import preview_keys
from services.weights.errors import WeightsError

MAX_HEADER_BYTES = 100_000_000
"""The largest header accepted; the limit the safetensors library itself enforces."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
METADATA = "__metadata__"


class Entry:
    __slots__ = ("begin", "dtype", "end", "name", "shape")

    def __init__(self, name: str, dtype: torch.dtype, shape: list[int], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def parse_header(where: str, body: bytes) -> list[Entry]:
    """The header's tensors in stream order; WeightsError for anything not safetensors."""
    try:
        parsed = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise WeightsError(
            f"{where}: the safetensors header is not JSON ({exc}); leading bytes {body[:32]!r}"
        ) from None
    if not isinstance(parsed, dict):
        raise WeightsError(
            f"{where}: the safetensors header is a JSON {type(parsed).__name__}, not an object"
        )
    metadata = parsed.pop(METADATA, {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise WeightsError(f"{where}: __metadata__ must map strings to strings")
    if not parsed:
        raise WeightsError(f"{where}: the safetensors header lists no tensors")
    entries = [_entry(where, name, info) for name, info in parsed.items()]
    entries.sort(key=lambda e: (e.begin, e.end))
    offset = 0
    for entry in entries:
        if entry.begin != offset:
            raise WeightsError(
                f"{where}: tensor {entry.name!r} starts at byte {entry.begin} of the data, "
                f"the previous one ends at {offset}: data_offsets must be contiguous"
            )
        offset = entry.end
    return entries


def _entry(where: str, name: str, info: Any) -> Entry:
    if not isinstance(info, dict):
        raise WeightsError(f"{where}: header entry {name!r} is not an object")
    code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    dtype = DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise WeightsError(
            f"{where}: tensor {name!r} has unknown dtype {code!r} (known: {', '.join(DTYPES)})"
        )
    if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
        raise WeightsError(f"{where}: tensor {name!r} has invalid shape {shape!r}")
    if not (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(_is_count(o) for o in offsets)
        and offsets[0] <= offsets[1]
    ):
        raise WeightsError(f"{where}: tensor {name!r} has invalid data_offsets {offsets!r}")
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise WeightsError(
            f"{where}: tensor {name!r} ({code} {shape}) needs {nbytes} bytes, its "
            f"data_offsets {offsets} span {offsets[1] - offsets[0]}"
        )
    return Entry(name, dtype, shape, offsets[0], offsets[1])


def check_fits(
    where: str,
    tensors: Iterable[tuple[str, torch.dtype, list[int]]],
    destination: Mapping[str, Tensor],
) -> None:
    """Refuse a stream of ``(name, dtype, shape)`` tensors that ``destination`` cannot take as
    it is: the same names, and each with the same dtype and shape (no conversion in place)."""
    described = {name: (dtype, list(shape)) for name, dtype, shape in tensors}
    missing = sorted(set(described) - set(destination))
    if missing:
        raise WeightsError(
            f"{where}: the destination has no tensor {_names(missing)}; the stream must hold "
            "exactly the destination's tensors (weights of another model?)"
        )
    unsent = sorted(set(destination) - set(described))
    if unsent:
        raise WeightsError(
            f"{where}: the stream has no tensor {_names(unsent)} of the destination; the stream "
            "must hold exactly the destination's tensors (weights of another model?)"
        )
    for name, (dtype, shape) in described.items():
        tensor = destination[name]
        if tensor.dtype != dtype or list(tensor.shape) != shape:
            hint = ": the trainer and inference must use the same dtype"
            raise WeightsError(
                f"{where}: tensor {name!r} is {dtype} {shape} in the stream but {tensor.dtype} "
                f"{list(tensor.shape)} in the destination{hint if tensor.dtype != dtype else ''}"
            )


def _names(names: list[str]) -> str:
    return preview_keys([repr(n) for n in names], limit=5)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice")
        result[key] = value
    return result
