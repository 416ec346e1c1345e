"""The safetensors stream of the direct transports: a standard file, built from views of the
tensors, received in place, and refused with a clear message whenever anything is off."""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from services.weights import EncodedStream, StreamDecoder, WeightsError
from services.weights.digest import digest_of
from services.weights.stream import byte_view, split

WHERE = "weights for run_a step 3"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w.lora_B.weight": torch.randn(6, 4, generator=g),
        "w.lora_A.weight": torch.randn(4, 10, generator=g).to(torch.bfloat16),
        "half": torch.randn(3, generator=g).to(torch.float16),
        "ids": torch.arange(-5, 6, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(9, dtype=torch.uint8),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "transposed": torch.arange(12, dtype=torch.float32).reshape(3, 4).t(),
    }


def _decode(data: bytes, size: int | None = None, digest: str | None = None, **kw: Any):
    """Feed ``data`` to a decoder as a transport would: header, then the targets."""
    decoder = StreamDecoder(
        WHERE,
        len(data) if size is None else size,
        digest or "sha256:" + hashlib.sha256(data).hexdigest(),
        **kw,
    )
    length = StreamDecoder.header_length(data[:8])
    decoder.feed_header(data[: 8 + length])
    offset = 8 + length
    for target in decoder.targets():
        target[:] = data[offset : offset + len(target)]
        offset += len(target)
    return decoder.finish()


def _file(entries: Any, data: bytes = b"") -> bytes:
    return _raw(json.dumps(entries).encode(), data)


def _raw(body: bytes, data: bytes = b"") -> bytes:
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body + data


def test_the_stream_is_a_safetensors_file_with_sorted_names():
    state = _state()
    stream = EncodedStream.from_state_dict(state)
    data = stream.to_bytes()
    assert stream.size == len(data)
    assert stream.digest == digest_of([data])
    (length,) = struct.unpack("<Q", data[:8])
    assert stream.header == data[: 8 + length] and length % 8 == 0
    header = json.loads(data[8 : 8 + length])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert list(header) == sorted(state)
    # sorted names: bytes (9), empty (0), half (6), ids (88), mask (3), scalar (4), transposed (48)
    assert header["w.lora_A.weight"] == {
        "dtype": "BF16",
        "shape": [4, 10],
        "data_offsets": [158, 238],
    }
    assert header["w.lora_B.weight"]["data_offsets"] == [238, 238 + 96]
    loaded = st_load(data)
    assert set(loaded) == set(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_contiguous_cpu_tensors_are_sent_from_their_own_memory():
    state = _state()
    stream = EncodedStream.from_state_dict(state)
    segments = list(stream.segments())
    assert bytes(segments[0]) == stream.header
    for name, view in zip(stream.names, segments[1:], strict=True):
        tensor = state[name]
        if tensor.is_contiguous() and tensor.numel():
            assert np.asarray(view).ctypes.data == tensor.data_ptr(), name
    # the transposed tensor was made contiguous: a copy, holding the same values in row order
    assert bytes(segments[1 + stream.names.index("transposed")]) == (
        state["transposed"].contiguous().numpy().tobytes()
    )


def test_chunks_are_the_same_bytes_in_bounded_pieces_that_never_span_two_tensors():
    stream = EncodedStream.from_state_dict(_state())
    pieces = list(split(stream.segments(), 16))
    assert b"".join(bytes(p) for p in pieces) == stream.to_bytes()
    assert all(0 < len(p) <= 16 for p in pieces)
    expected = sum(-(-len(s) // 16) for s in stream.segments())
    assert len(pieces) == expected
    with pytest.raises(ValueError, match="chunk_bytes must be positive"):
        list(split(stream.segments(), 0))


def test_a_decoded_stream_equals_what_was_encoded():
    state = _state()
    stream = EncodedStream.from_state_dict(state)
    got = _decode(stream.to_bytes(), digest=stream.digest)
    assert list(got) == sorted(state)
    for name, tensor in state.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name], tensor), name


def test_a_destination_receives_in_place():
    source = _state()
    destination = {k: torch.zeros_like(v).contiguous() for k, v in source.items()}
    pointers = {k: v.data_ptr() for k, v in destination.items()}
    stream = EncodedStream.from_state_dict(source)
    got = _decode(stream.to_bytes(), destination=destination)
    for name in source:
        assert got[name] is destination[name]
        assert got[name].data_ptr() == pointers[name]
        assert torch.equal(destination[name], source[name]), name


def test_targets_are_writable_views_in_stream_order():
    stream = EncodedStream.from_state_dict({"b": torch.ones(2), "a": torch.zeros(3)})
    decoder = StreamDecoder(WHERE, stream.size, stream.digest)
    decoder.feed_header(stream.header)
    assert [len(t) for t in decoder.targets()] == [12, 8]  # a (3 x f32), then b
    assert all(not t.readonly for t in decoder.targets())


def test_header_length_reads_the_prefix_and_checks_it_against_the_size():
    assert StreamDecoder.header_length(struct.pack("<Q", 64)) == 64
    decoder = StreamDecoder(WHERE, 100, "sha256:" + "0" * 64)
    with pytest.raises(WeightsError, match=f"^{WHERE}: the header length prefix of a 100-byte"):
        decoder.header_length(struct.pack("<Q", 200), decoder.size, decoder.where)
    with pytest.raises(WeightsError, match="starts with an 8-byte header length, got 3 bytes"):
        StreamDecoder.header_length(b"abc")


def test_encoding_refuses_what_safetensors_cannot_hold():
    with pytest.raises(ValueError, match="no tensors"):
        EncodedStream.from_state_dict({})
    with pytest.raises(ValueError, match=r"dtype torch\.complex64 has no safetensors code"):
        EncodedStream.from_state_dict({"c": torch.zeros(2, dtype=torch.complex64)})
    with pytest.raises(ValueError, match="cannot encode a tensor named '__metadata__'"):
        EncodedStream.from_state_dict({"__metadata__": torch.zeros(1)})


_F32_2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (struct.pack("<Q", 1 << 40) + b"{}", "the header length prefix of a 10-byte stream says"),
        (_raw(b"not json"), r"the safetensors header is not JSON"),
        (_file(["a", "b"]), "the safetensors header is a JSON list, not an object"),
        (_file({}), "the safetensors header lists no tensors"),
        (_file({"x": {**_F32_2, "dtype": "F12"}}, bytes(8)), "tensor 'x' has unknown dtype 'F12'"),
        (_file({"x": {**_F32_2, "shape": [-2]}}, bytes(8)), r"tensor 'x' has invalid shape \[-2\]"),
        (
            _file({"x": {**_F32_2, "data_offsets": [0, 12]}}, bytes(12)),
            r"tensor 'x' \(F32 \[2\]\) needs 8 bytes, its data_offsets \[0, 12\] span 12",
        ),
        (
            _file({"x": _F32_2, "y": {**_F32_2, "data_offsets": [12, 20]}}, bytes(20)),
            "tensor 'y' starts at byte 12 of the data, the previous one ends at 8: "
            "data_offsets must be contiguous",
        ),
        (_file({"x": _F32_2, "z": {"dtype": "F32", "shape": [2]}}, bytes(8)), "invalid data_"),
        (_file({"x": _F32_2, "__metadata__": {"a": 1}}, bytes(8)), "__metadata__ must map"),
        (
            _raw(b'{"x":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"x":1}'),
            "key 'x' appears twice",
        ),
    ],
    ids=[
        "prefix",
        "garbage",
        "list",
        "empty",
        "dtype",
        "shape",
        "span",
        "gap",
        "offsets",
        "metadata",
        "duplicate",
    ],
)
def test_a_malformed_header_is_refused(data: bytes, message: str):
    decoder = StreamDecoder(WHERE, len(data), "sha256:" + hashlib.sha256(data).hexdigest())
    with pytest.raises(WeightsError, match=f"^{WHERE}: .*{message}"):
        decoder.feed_header(data[: len(data) - _data_length(data)])


def _data_length(data: bytes) -> int:
    (length,) = struct.unpack("<Q", data[:8])
    return max(0, len(data) - 8 - length)


def test_a_size_other_than_announced_is_refused_before_anything_is_received():
    stream = EncodedStream.from_state_dict({"x": torch.ones(4)})
    decoder = StreamDecoder(WHERE, stream.size + 4, stream.digest)
    with pytest.raises(
        WeightsError,
        match=rf"^{WHERE}: size mismatch: the header describes {stream.size} bytes "
        rf"\({len(stream.header)} of header, 16 of tensors\), {stream.size + 4} were announced",
    ):
        decoder.feed_header(stream.header)


def test_a_changed_byte_fails_the_digest_check():
    stream = EncodedStream.from_state_dict({"x": torch.ones(4)})
    data = bytearray(stream.to_bytes())
    data[-1] ^= 1
    tampered = digest_of([data])
    with pytest.raises(
        WeightsError,
        match=f"^{WHERE}: digest mismatch: announced {stream.digest} but the {len(data)} received "
        f"bytes hash to {tampered}$",
    ):
        _decode(bytes(data), digest=stream.digest)


@pytest.mark.parametrize(
    ("destination", "message"),
    [
        (
            {"x": torch.zeros(3, 2)},
            r"'x' is torch.float32 \[2, 3\] in the stream but "
            r"torch.float32 \[3, 2\] in the destination",
        ),
        ({"x": torch.zeros(2, 3, dtype=torch.float16)}, "in the destination"),
        ({"y": torch.zeros(2, 3)}, "the destination has no tensor 'x'"),
    ],
    ids=["shape", "dtype", "missing"],
)
def test_a_destination_that_does_not_fit_is_refused(destination, message):
    stream = EncodedStream.from_state_dict({"x": torch.ones(2, 3)})
    decoder = StreamDecoder(WHERE, stream.size, stream.digest, destination)
    with pytest.raises(WeightsError, match=f"^{WHERE}: .*{message}"):
        decoder.feed_header(stream.header)


def _strided(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` that is not contiguous, as one on a GPU cannot be written in place."""
    out = torch.zeros(tensor.numel() * 2, dtype=tensor.dtype)[::2].view(tensor.shape)
    return out.copy_(tensor)


def test_destination_tensors_not_writable_in_place_are_staged_and_copied_after_the_digest():
    sent = {"x": torch.arange(6.0).view(2, 3), "y": torch.arange(4.0), "z": torch.ones(5)}
    stream = EncodedStream.from_state_dict(sent)
    destination = {
        "x": _strided(torch.zeros(2, 3)),
        "y": torch.zeros(4),
        "z": _strided(torch.zeros(5)),
    }
    assert not destination["x"].is_contiguous() and not destination["z"].is_contiguous()
    decoder = StreamDecoder(WHERE, stream.size, stream.digest, destination)
    for piece in split(stream.segments(), 7):  # cut across tensors, as the store's chunks are
        decoder.feed(piece)
    # Before the digest is checked: the contiguous tensor holds the bytes, the others do not.
    assert torch.equal(destination["y"], sent["y"])
    assert not destination["x"].any() and not destination["z"].any()
    got = decoder.finish()
    assert all(got[k] is destination[k] and torch.equal(got[k], sent[k]) for k in sent)


@pytest.mark.parametrize("in_place", [False, True], ids=["all-staged", "partly-in-place"])
def test_a_bad_digest_leaves_staged_tensors_alone_and_touched_says_so(in_place: bool):
    sent = {"x": torch.arange(6.0).view(2, 3), "y": torch.arange(4.0)}
    stream = EncodedStream.from_state_dict(sent)
    destination = {"x": _strided(torch.zeros(2, 3)), "y": _strided(torch.zeros(4))}
    if in_place:
        destination["y"] = torch.zeros(4)
    decoder = StreamDecoder(WHERE, stream.size, "sha256:" + "0" * 64, destination)
    for piece in split(stream.segments(), 5):
        decoder.feed(piece)
    with pytest.raises(WeightsError, match="digest mismatch") as err:
        decoder.finish()
    assert err.value.touched is in_place
    assert not destination["x"].any()
    assert torch.equal(destination["y"], sent["y"] if in_place else torch.zeros(4))


def test_misuse_is_reported_not_crashed():
    stream = EncodedStream.from_state_dict({"x": torch.ones(2)})
    decoder = StreamDecoder(WHERE, stream.size, stream.digest)
    with pytest.raises(WeightsError, match="nothing was received"):
        decoder.finish()
    with pytest.raises(WeightsError, match=r"targets\(\) before feed_header\(\)"):
        decoder.targets()
    decoder.feed_header(stream.header)
    with pytest.raises(WeightsError, match="the header was fed twice"):
        decoder.feed_header(stream.header)


def test_byte_view_shares_the_tensor_memory():
    tensor = torch.zeros(3, dtype=torch.int16)
    view = byte_view(tensor)
    view[0:2] = b"\x07\x00"
    assert tensor.tolist() == [7, 0, 0]


def _receive_in_pieces(data: bytes, piece: int, digest: str | None = None) -> StreamDecoder:
    """A decoder that has received ``data`` ``piece`` bytes at a time, telling it each time."""
    decoder = StreamDecoder(
        WHERE, len(data), digest or "sha256:" + hashlib.sha256(data).hexdigest()
    )
    length = StreamDecoder.header_length(data[:8])
    decoder.feed_header(data[: 8 + length])
    flat = data[8 + length :]
    done = 0
    for target in decoder.targets():
        for start in range(0, len(target), piece):
            stop = min(start + piece, len(target))
            target[start:stop] = flat[done + start : done + stop]
            decoder.landed(done + stop)
        done += len(target)
    return decoder


@pytest.mark.parametrize("piece", [1, 7, 64, 1 << 20])
def test_hashing_while_the_data_lands_gives_the_same_verdicts(piece: int):
    state = _state()
    data = EncodedStream.from_state_dict(state).to_bytes()
    got = _receive_in_pieces(data, piece).finish()
    assert all(torch.equal(got[k], state[k].contiguous()) for k in state)
    with pytest.raises(WeightsError, match="digest mismatch"):
        _receive_in_pieces(data, piece, digest="sha256:" + "0" * 64).finish()


def test_a_byte_that_lands_corrupted_fails_the_digest_hashed_while_landing():
    # The last byte of the last piece, the one hashed at the very end.
    data = bytearray(EncodedStream.from_state_dict(_state()).to_bytes())
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    data[-1] ^= 0xFF
    with pytest.raises(WeightsError, match="digest mismatch"):
        _receive_in_pieces(bytes(data), 16, digest=digest).finish()


def test_an_abandoned_transfer_stops_its_hashing_thread():
    data = EncodedStream.from_state_dict(_state()).to_bytes()
    decoder = StreamDecoder(WHERE, len(data), "sha256:" + hashlib.sha256(data).hexdigest())
    length = StreamDecoder.header_length(data[:8])
    decoder.feed_header(data[: 8 + length])
    decoder.landed(5)  # starts the thread, which then waits for more
    assert decoder._hasher is not None and decoder._hasher.is_alive()
    decoder.abandon()
    assert not decoder._hasher.is_alive()


@pytest.mark.parametrize("piece", [1, 5, 8, 13, 100, 1 << 20])
def test_a_stream_fed_in_pieces_cut_anywhere_lands_in_place(piece: int):
    # Pieces straddle the prefix, the header, the tensors and the empty one.
    state = _state()
    destination = {k: torch.zeros_like(v).contiguous() for k, v in state.items()}
    pointers = {k: v.data_ptr() for k, v in destination.items()}
    stream = EncodedStream.from_state_dict(state)
    data = stream.to_bytes()
    decoder = StreamDecoder(WHERE, stream.size, stream.digest, destination)
    for start in range(0, len(data), piece):
        decoder.feed(data[start : start + piece])
    got = decoder.finish()
    for name, tensor in state.items():
        assert got[name] is destination[name] and got[name].data_ptr() == pointers[name]
        assert torch.equal(got[name], tensor), name


def test_feeding_too_little_or_too_much_is_refused():
    stream = EncodedStream.from_state_dict({"x": torch.ones(4)})
    data = stream.to_bytes()
    short = StreamDecoder(WHERE, stream.size, stream.digest)
    short.feed(data[:-1])
    with pytest.raises(
        WeightsError,
        match=f"^{WHERE}: size mismatch: announced {stream.size} bytes, received "
        f"{stream.size - 1}$",
    ):
        short.finish()
    long = StreamDecoder(WHERE, stream.size, stream.digest)
    with pytest.raises(WeightsError, match=f"more bytes than the {stream.size} the header"):
        long.feed(data + b"x")
    long.abandon()
    mixed = StreamDecoder(WHERE, stream.size, stream.digest)
    mixed.feed_header(stream.header)
    with pytest.raises(WeightsError, match=r"feed\(\) after feed_header\(\)"):
        mixed.feed(data)


def test_only_a_failure_after_the_destination_was_handed_out_is_touched():
    stream = EncodedStream.from_state_dict({"x": torch.ones(4)})
    data = bytearray(stream.to_bytes())
    data[-1] ^= 1
    # Refused from the header: nothing of the destination was handed out.
    wrong = StreamDecoder(WHERE, stream.size, stream.digest, {"x": torch.zeros(5)})
    with pytest.raises(WeightsError) as err:
        wrong.feed(data)
    assert err.value.touched is False and wrong.touched is False
    # The bytes landed, then failed the digest: touched, and only with a destination.
    for destination, touched in (({"x": torch.zeros(4)}, True), (None, False)):
        decoder = StreamDecoder(WHERE, stream.size, stream.digest, destination)
        decoder.feed(data)
        assert decoder.touched is touched
        with pytest.raises(WeightsError, match="digest mismatch") as err:
            decoder.finish()
        assert err.value.touched is touched
