"""The gateway's protobuf codec against the Tinker SDK's own encoder and decoder."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from hypothesis import given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import (
    deserialize_forward_backward_output,
    deserialize_sample_response,
)

from services.gateway import wire


def _datum(tokens: list[int], targets: list[int], weights: list[float]) -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData(data=targets, dtype="int64", shape=[len(targets)]),
            "weights": tinker.TensorData(data=weights, dtype="float32", shape=[len(weights)]),
        },
    )


def test_forward_backward_request_as_the_sdk_writes_it() -> None:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum([1, 5, 6], [5, 6, 2], [0.0, 1.0, 0.5]), _datum([1, 9], [9, 2], [1, 1])],
            loss_fn="ppo",
            loss_fn_config={"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
        ),
        model_id="run_abc",
        seq_id=7,
    )
    proto = forward_backward_request_to_proto(request)
    proto.forward_only = True
    got = wire.decode_forward_backward(proto.SerializeToString())
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("run_abc", 7, "ppo", True)
    assert got.loss_fn_config == pytest.approx(
        {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}
    )
    assert [d.tokens for d in got.data] == [[1, 5, 6], [1, 9]]
    assert got.data[0].loss_fn_inputs == {"target_tokens": [5, 6, 2], "weights": [0.0, 1.0, 0.5]}
    assert got.data[1].loss_fn_inputs["target_tokens"] == [9, 2]


def test_garbage_is_a_wire_error() -> None:
    with pytest.raises(wire.WireError):
        wire.decode_forward_backward(b"\x0a\xff\xff\xff")
    with pytest.raises(wire.WireError):
        wire.decode_forward_backward(b"\x0f")
    with pytest.raises(wire.WireError, match="not UTF-8"):
        wire.decode_forward_backward(b"\x0a\x02\xff\xfe")  # model_id
    with pytest.raises(wire.WireError, match="whole number of int32"):
        wire.decode_forward_backward(b"\x1a\x07\x0a\x05\x0a\x03\x0a\x01\x05")  # 1 token byte


_VALID = forward_backward_request_to_proto(
    types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[_datum([1, 5, 6], [5, 6, 2], [0.0, 1.0, 0.5])],
            loss_fn="cross_entropy",
            loss_fn_config={"clip_low_threshold": 0.7},
        ),
        model_id="run_abc",
        seq_id=3,
    )
).SerializeToString()


@settings(max_examples=400, derandomize=True, deadline=None, database=None)
@given(
    data=st.binary(max_size=200)
    | st.builds(lambda cut: _VALID[:cut], st.integers(0, len(_VALID)))
    | st.builds(
        lambda at, b: _VALID[:at] + bytes([b]) + _VALID[at + 1 :],
        st.integers(0, len(_VALID) - 1),
        st.integers(0, 255),
    )
)
def test_any_bytes_decode_or_are_a_wire_error(data: bytes) -> None:
    """Never another exception: the route turns a WireError into a 400 and nothing else."""
    try:
        wire.decode_forward_backward(data)
    except wire.WireError:
        pass


def test_sample_response_reads_back_in_the_sdk() -> None:
    data = wire.encode_sample_response(
        [([4, 5, 2], [-0.5, -1.25, -0.125], "stop"), ([7], [-3.0], "length")]
    )
    got = deserialize_sample_response(data)
    assert [s.tokens for s in got.sequences] == [[4, 5, 2], [7]]
    assert [s.stop_reason for s in got.sequences] == ["stop", "length"]
    assert got.sequences[0].logprobs == [-0.5, -1.25, -0.125]


def test_forward_backward_output_reads_back_in_the_sdk() -> None:
    outputs = [
        {"logprobs": [-1.0, -2.0, -0.5], "elementwise_loss": [1.0, 2.0, 0.5]},
        {"logprobs": [-0.25], "elementwise_loss": [0.25]},
    ]
    got = deserialize_forward_backward_output(
        wire.encode_forward_backward_output(outputs, {"loss:sum": 3.75})
    )
    assert got.metrics == {"loss:sum": 3.75}
    assert len(got.loss_fn_outputs) == 2
    first = got.loss_fn_outputs[0]
    assert np.allclose(first["logprobs"].to_numpy(), [-1.0, -2.0, -0.5])
    assert np.allclose(got.loss_fn_outputs[1]["elementwise_loss"].to_numpy(), [0.25])
