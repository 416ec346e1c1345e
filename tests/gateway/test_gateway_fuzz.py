"""Malformed HTTP requests on every route of the gateway, against the real stack.

Each route starts from a request the ``tinker`` SDK or an OpenAI client would send; Hypothesis
mutates it one to three times (a field dropped, or set to any JSON value: NaN and infinities,
integers past 64 bits, strings, lists, objects, nested as deep as it likes), or replaces the
whole body (JSON that is not an object, bytes that are not JSON or not UTF-8, a protobuf
``forward_backward`` cut short or with flipped bytes). What must hold for every one of them:

- the answer is a 4xx with the route family's error shape (Tinker's ``{"detail": str}``,
  OpenAI's ``{"error": {"message": str, ...}}``), or a success: never a 5xx, never a dropped
  connection;
- a Tinker future it started ends with a result or with an error of category ``user``, never
  ``server``;
- the gateway logs no traceback, and after every route's batch the good requests still work
  (an OpenAI completion, a Tinker sample of the base model, a forward_backward of the run).

The examples are fixed (``derandomize``); ``PLEXRL_FUZZ_EXAMPLES`` searches longer.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from gateway_support import Stack, evict_runs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from services.envs import ReverseEnv, prompt_token_ids
from services.model.loader import load_tokenizer

pytestmark = pytest.mark.timeout(900)

EXAMPLES = int(os.environ.get("PLEXRL_FUZZ_EXAMPLES", "20"))
BASE = "tiny-base"

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "encoded_text", "image", "adamw", BASE, "run_x", "tinker://run_x/"])
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda kids: (
        st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4)
    ),
    max_leaves=10,
)


@dataclass
class Route:
    path: str
    body: Callable[[Ctx], dict[str, Any]]


@dataclass
class Ctx:
    """What the valid requests refer to: a live run of the tests' own, and prompt tokens."""

    url: str
    run_id: str
    prompt: list[int]
    created: set[str] = field(default_factory=set)
    """runs a mutated create_model made: evicted after each test, the stack's slots are shared"""
    session: str = field(default_factory=lambda: f"fuzz-{uuid.uuid4().hex[:8]}")
    """the session of the tests' create_model bodies: a new one after each eviction, since an
    evicted run's id is never admitted again"""


ROUTES = [
    Route("/api/v1/create_session", lambda c: {"tags": [], "user_metadata": None}),
    Route("/api/v1/session_heartbeat", lambda c: {"session_id": "s"}),
    Route(
        "/api/v1/create_sampling_session",
        lambda c: {"session_id": "s", "sampling_session_seq_id": 0, "base_model": BASE},
    ),
    Route(
        "/api/v1/asample",
        lambda c: {
            "base_model": BASE,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": c.prompt}]},
            "num_samples": 2,
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 3, "stop": ["="]},
        },
    ),
    Route(
        "/api/v1/create_model",
        lambda c: {
            "session_id": c.session,
            "model_seq_id": 0,
            "base_model": BASE,
            "lora_config": {"rank": 4, "seed": 1},
            "optimizer_config": {"type": "adamw"},
        },
    ),
    Route("/api/v1/get_info", lambda c: {"model_id": c.run_id}),
    Route(
        "/api/v1/optim_step",
        lambda c: {"model_id": c.run_id, "adam_params": {"learning_rate": 1e-4}},
    ),
    Route(
        "/api/v1/save_weights_for_sampler",
        lambda c: {"model_id": c.run_id, "path": "fuzz", "sampling_session_seq_id": 1},
    ),
    Route("/api/v1/save_weights", lambda c: {"model_id": c.run_id, "path": "fuzz"}),
    Route(
        "/api/v1/load_weights",
        lambda c: {"model_id": c.run_id, "path": f"tinker://{c.run_id}/weights/fuzz"},
    ),
    Route("/api/v1/retrieve_future", lambda c: {"request_id": "sample:none"}),
    Route("/v1/completions", lambda c: {"model": BASE, "prompt": "abc=", "max_tokens": 4}),
    Route(
        "/v1/chat/completions",
        lambda c: {"model": BASE, "messages": [{"role": "user", "content": "ab"}], "max_tokens": 4},
    ),
]


def _fb_proto(ctx: Ctx, seq_id: int) -> bytes:
    tokens = [*ctx.prompt, 5, 6]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=ctx.run_id,
        seq_id=seq_id,
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def _post_json(url: str, body: Any) -> httpx.Response:
    return httpx.post(url, json=body, timeout=120)


def _wait_future(ctx: Ctx, request_id: str) -> httpx.Response:
    deadline = time.monotonic() + 120
    while True:
        got = _post_json(f"{ctx.url}/api/v1/retrieve_future", {"request_id": request_id})
        if got.headers.get("content-type", "").startswith("application/json"):
            body = got.json()
            if body.get("type") == "try_again" and time.monotonic() < deadline:
                continue
        return got


def _check(ctx: Ctx, path: str, sent: bytes, got: httpx.Response) -> None:
    what = f"POST {path} {sent[:300]!r} -> {got.status_code} {got.text[:300]}"
    assert got.status_code < 500, what
    if got.status_code >= 400:
        body = got.json()
        if path.startswith("/api/"):
            assert isinstance(body.get("detail"), str) and body["detail"], what
        else:
            assert isinstance(body["error"]["message"], str) and body["error"]["message"], what
        return
    if not path.startswith("/api/") or path.endswith("retrieve_future"):
        return
    request_id = got.json().get("request_id")
    if request_id is None:
        return
    if path.endswith("/create_model"):
        ctx.created.add(got.json()["model_id"])
    outcome = _wait_future(ctx, request_id)
    assert outcome.status_code == 200, f"{what}\nfuture: {outcome.status_code} {outcome.text[:300]}"
    if outcome.headers.get("content-type", "").startswith("application/json"):
        body = outcome.json()
        assert body.get("category") != "server", f"{what}\nfuture: {body}"
        assert body.get("type") != "try_again", f"{what}\nfuture still running after 120 s"


def _good_requests_work(ctx: Ctx, stack: Stack) -> None:
    text = _post_json(
        f"{ctx.url}/v1/completions", {"model": BASE, "prompt": "abc=", "max_tokens": 4}
    )
    assert text.status_code == 200 and text.json()["choices"], text.text
    sample = _post_json(
        f"{ctx.url}/api/v1/asample",
        {
            "base_model": BASE,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": ctx.prompt}]},
            "num_samples": 1,
            "sampling_params": {"max_tokens": 4},
        },
    )
    assert sample.status_code == 200, sample.text
    done = _wait_future(ctx, sample.json()["request_id"])
    assert done.headers["content-type"].startswith("application/x-protobuf"), done.text
    fb = httpx.post(
        f"{ctx.url}/api/v1/forward_backward",
        content=_fb_proto(ctx, 0),
        headers={"content-type": "application/x-protobuf"},
        timeout=120,
    )
    assert fb.status_code == 200, fb.text
    done = _wait_future(ctx, fb.json()["request_id"])
    assert done.headers["content-type"].startswith("application/x-protobuf"), done.text
    assert stack.procs["gateway"].poll() is None
    assert "Traceback" not in stack.log("gateway"), stack.log("gateway")[-4000:]


@pytest.fixture(scope="module")
def ctx(stack: Stack) -> Iterator[Ctx]:
    """A live training run of the tests' own (made through ``create_model``, as the SDK does),
    its session kept alive by heartbeats as the SDK keeps it (a silent session is finished and
    its runs evicted after the gateway's session TTL, which a slow module outlasts)."""
    tok = load_tokenizer(stack.model)
    prompt = prompt_token_ids(tok, ReverseEnv(seed=0).prompt(0))
    session = f"fuzz-{uuid.uuid4().hex[:8]}"
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(5.0):
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{stack.url}/api/v1/session_heartbeat", json={"session_id": session})

    beating = threading.Thread(target=beat, name="heartbeat", daemon=True)
    beating.start()
    body = {
        "session_id": session,
        "model_seq_id": 0,
        "base_model": BASE,
        "lora_config": {"rank": 4},
    }
    made = _post_json(f"{stack.url}/api/v1/create_model", body)
    assert made.status_code == 200, made.text
    c = Ctx(stack.url, made.json()["model_id"], prompt)
    created = _wait_future(c, made.json()["request_id"])
    assert created.json().get("model_id") == c.run_id, created.text
    yield c
    stop.set()
    beating.join()
    # finished, its run is evicted at once: the other gateway tests of this process need the slot
    finished = httpx.post(f"{stack.url}/api/v1/sessions/{session}/finish", json={})
    assert finished.status_code == 200, finished.text


@pytest.fixture(autouse=True)
def evict_created(ctx: Ctx, stack: Stack) -> Iterator[None]:
    """Evict the runs a test's mutated create_model requests made (the other gateway tests of
    this process need the stack's run slots)."""
    yield
    gone, ctx.created = ctx.created - {ctx.run_id}, set()
    ctx.session = f"fuzz-{uuid.uuid4().hex[:8]}"
    evict_runs(stack, gone, "fuzz")


def _profile(examples: int) -> settings:
    """The same ``examples`` on every run, no time limit per example (each one is a request
    to the stack), one stack for all of them."""
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON document a mutation can reach."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """A mutation of ``valid``, or a body of another kind altogether, as bytes on the wire."""
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "json", "bytes"]))
    if kind == "json":
        return json.dumps(draw(JSON_VALUES)).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=64) | st.just(b'{"model": "\xff\xfe"}'))
    body = json.loads(json.dumps(valid))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(body)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if draw(st.booleans()) and isinstance(parent, dict):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(JSON_VALUES)
        if not isinstance(body, dict):
            break
    return json.dumps(body).encode()


@pytest.mark.parametrize("route", ROUTES, ids=[r.path.split("/v1/", 1)[-1] for r in ROUTES])
def test_malformed_json_on_every_route_is_a_clear_4xx(route: Route, ctx: Ctx, stack: Stack) -> None:
    valid = route.body(ctx)

    @_profile(EXAMPLES)
    @given(sent=mutated(valid))
    def one(sent: bytes) -> None:
        got = httpx.post(
            ctx.url + route.path,
            content=sent,
            headers={"content-type": "application/json"},
            timeout=120,
        )
        _check(ctx, route.path, sent, got)

    one()
    _good_requests_work(ctx, stack)


@st.composite
def broken_proto(draw: st.DrawFn, valid: bytes) -> bytes:
    kind = draw(st.sampled_from(["cut", "flip", "insert", "random"]))
    if kind == "random":
        return draw(st.binary(max_size=200))
    data = bytearray(valid)
    if kind == "cut":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] = draw(st.integers(0, 255))
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=6))
    return bytes(data)


def test_malformed_forward_backward_protobuf_is_a_clear_4xx(ctx: Ctx, stack: Stack) -> None:
    valid = _fb_proto(ctx, 1)

    @_profile(4 * EXAMPLES)
    @given(sent=broken_proto(valid))
    def one(sent: bytes) -> None:
        got = httpx.post(
            ctx.url + "/api/v1/forward_backward",
            content=sent,
            headers={"content-type": "application/x-protobuf"},
            timeout=120,
        )
        _check(ctx, "/api/v1/forward_backward", sent, got)

    one()
    _good_requests_work(ctx, stack)


NASTY = [float("nan"), float("inf"), -1, 0, 2**63, 2**70, "7", {}]
"""Values that have broken servers like this one: each is tried in every numeric field below."""
FIELDS = {
    "/api/v1/asample": [
        ("num_samples",),
        ("seq_id",),
        ("sampling_params", "max_tokens"),
        ("sampling_params", "temperature"),
        ("sampling_params", "top_p"),
        ("sampling_params", "top_k"),
        ("sampling_params", "seed"),
        ("sampling_params", "stop", 0),
        ("prompt", "chunks", 0, "tokens", 0),
    ],
    "/api/v1/create_model": [("model_seq_id",), ("lora_config", "rank"), ("lora_config", "seed")],
    "/api/v1/optim_step": [("adam_params", "learning_rate"), ("adam_params", "eps"), ("seq_id",)],
    "/api/v1/save_weights": [("seq_id",)],
    "/v1/completions": [("max_tokens",), ("temperature",), ("top_p",), ("n",), ("seed",)],
    "/v1/chat/completions": [("max_tokens",), ("temperature",), ("seed",), ("top_logprobs",)],
}


@pytest.mark.parametrize("path", list(FIELDS))
def test_extreme_numbers_in_every_numeric_field(path: str, ctx: Ctx, stack: Stack) -> None:
    valid = next(r for r in ROUTES if r.path == path).body(ctx)
    for where in FIELDS[path]:
        for value in NASTY:
            body = json.loads(json.dumps(valid))
            parent = body
            for key in where[:-1]:
                parent = parent[key]
            parent[where[-1]] = value
            sent = json.dumps(body).encode()
            got = httpx.post(
                ctx.url + path, content=sent, headers={"content-type": "application/json"}
            )
            _check(ctx, path, sent, got)
    _good_requests_work(ctx, stack)
