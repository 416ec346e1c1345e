"""An HTTP request's W3C ``traceparent`` continues into the gateway, inference and the trainer."""

from __future__ import annotations

import secrets
import time

import httpx
import pytest
import tinker
from tinker import types

pytestmark = pytest.mark.timeout(300)


def _trace(
    receiver,
    trace_id: str,
    services: set[str],
    timeout: float = 30.0,
    names: frozenset[tuple[str, str]] = frozenset(),
) -> list:
    """The trace's spans once every service in ``services`` (and every ``(service, name)`` in
    ``names``) has exported one, or what there is after ``timeout``: spans are exported in
    batches, and some start after the HTTP answer."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in receiver.snapshot() if s.trace_id == trace_id]
        have = {(s.service, s.name) for s in spans}
        if services <= {s.service for s in spans} and names <= have:
            return spans
        if time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def _traceparent() -> tuple[str, str]:
    trace_id = secrets.token_hex(16)
    return trace_id, f"00-{trace_id}-{secrets.token_hex(8)}-01"


def test_a_completion_is_one_trace_through_gateway_and_inference(stack, receiver) -> None:
    trace_id, header = _traceparent()
    made = httpx.post(
        f"{stack.url}/v1/completions",
        json={"model": "tiny-base", "prompt": "ab", "max_tokens": 2},
        headers={"traceparent": header},
        timeout=90,
    )
    assert made.status_code == 200, made.text
    expected = frozenset(
        {
            ("plexrl-gateway", "POST /v1/completions"),
            ("plexrl-gateway", "request plexrl.inference.generate"),
        }
    )
    spans = _trace(receiver, trace_id, {"plexrl-gateway", "plexrl-inference"}, names=expected)
    names = {(s.service, s.name) for s in spans}
    assert ("plexrl-gateway", "POST /v1/completions") in names, names
    assert ("plexrl-gateway", "request plexrl.inference.generate") in names, names
    assert "plexrl-inference" in {s.service for s in spans}, names
    ours = [s for s in spans if "plexrl.run_id" in s.attributes]  # not FastAPI's own spans
    assert [(s.name, s.attributes["plexrl.run_id"]) for s in ours] == [
        ("POST /v1/completions", "run_gateway_base")
    ]


def _traced_forward_backward(
    stack,
    receiver,
    services: set[str],
    wait: float = 30.0,
    names: frozenset[tuple[str, str]] = frozenset(),
) -> list:
    """Send one forward_backward with a traceparent (the SDK sends none of its own, so the
    request is built as a traced client would: a protobuf ForwardBackwardRequest); its spans."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    # the session ends once the spans are in: its run is freed for the stack's other tests
    with tinker.ServiceClient(base_url=stack.url, api_key="tml-plexrl-test") as service:
        trainer = service.create_lora_training_client(base_model="tiny-base", rank=4).result()
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 5, 6]),
            loss_fn_inputs={"target_tokens": [5, 6, 2]},
        )
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(
                data=[datum], loss_fn="cross_entropy"
            ),
            model_id=trainer.model_id,
            seq_id=1000,
        )
        trace_id, header = _traceparent()
        sent = httpx.post(
            f"{stack.url}/api/v1/forward_backward",
            content=forward_backward_request_to_proto(request).SerializeToString(),
            headers={"traceparent": header, "content-type": "application/x-protobuf"},
        )
        assert sent.status_code == 200, sent.text
        return _trace(receiver, trace_id, services, wait, names)


def test_a_tinker_forward_backward_carries_the_trace_onto_the_bus(stack, receiver) -> None:
    expected = frozenset(
        {
            ("plexrl-gateway", "POST /api/v1/forward_backward"),
            ("plexrl-gateway", "request plexrl.train.forward_backward"),
        }
    )
    spans = _traced_forward_backward(stack, receiver, {"plexrl-gateway"}, names=expected)
    names = {(s.service, s.name) for s in spans}
    assert ("plexrl-gateway", "POST /api/v1/forward_backward") in names, names
    # the future's work runs after the HTTP answer, still inside the request's trace
    assert ("plexrl-gateway", "request plexrl.train.forward_backward") in names, names


def test_a_tinker_forward_backward_reaches_the_trainer_in_its_trace(stack, receiver) -> None:
    spans = _traced_forward_backward(stack, receiver, {"plexrl-gateway", "plexrl-trainer"})
    names = {(s.service, s.name) for s in spans}
    assert ("plexrl-trainer", "train forward_backward") in names, names
