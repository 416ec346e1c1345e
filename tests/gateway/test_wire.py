"""The gateway's protobuf codec against the Tinker SDK's own encoder and decoder."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
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
