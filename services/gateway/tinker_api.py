"""The Tinker API, part one: client set-up, sessions, sampling and futures (``/api/v1``).

What the ``tinker`` SDK sends, and what plexrl answers:

- ``client/config``, ``client/dynamic_config``: the feature flags that keep the SDK on the
  paths implemented here (API-key auth, plain httpx, uncompressed and serial
  ``forward_backward`` chunks, per-request ``retrieve_future``).
- ``telemetry``, ``healthz``: accepted. Sessions are in :mod:`services.gateway.tinker_sessions`.
- ``get_server_capabilities``: the one base model this deployment serves.
- ``create_sampling_session``, ``samplers/{id}``, ``asample``: sampling through
  ``plexrl.inference.generate``. A sampling session's id names what it samples (a run at exactly
  one saved version, or the base model, which needs no run), so any gateway process can serve
  it. A sampler of saved weights is pinned on creation: the replica keeps that version as a
  snapshot while the run trains on. ``asample`` also scores the prompt
  (``include_prompt_logprobs``, ``compute_logprobs``), reports the most likely tokens
  (``topk_prompt_logprobs``, ``topk_sample_logprobs``), samples ``top_k``, runs to the context's
  end without ``max_tokens`` and through end-of-sequence with ``stop=[]``.
- ``retrieve_future``: a future's outcome, held for up to ``poll_s`` while it runs, then
  ``try_again``; results the SDK reads as protobuf (samples, forward_backward outputs) are sent
  as protobuf. ``cancel_future`` cancels a sample still running, in inference too (training
  commands already sent cannot be called back: 400). An ``asample`` past the gateway's bound on
  generation under way is a 429 with ``Retry-After`` at once, before any future is made.

The training routes are in :mod:`services.gateway.tinker_training`, checkpoints and training
runs in :mod:`services.gateway.tinker_checkpoints`. Routes the SDK knows and plexrl does not
implement (custom losses...) answer 404 with ``{"detail": ...}``, which the SDK raises as
``NotFoundError``.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.gateway import wire
from services.gateway.admission import Ticket
from services.gateway.app import Scope, gateway_of, parse_body, read_json
from services.gateway.backend import GatewayError, ModelRef
from services.gateway.futures import Outcome
from services.gateway.observe import note_run
from services.gateway.tinker_bodies import FutureBody, SampleBody, SamplingSessionBody

router = APIRouter(prefix="/api/v1")

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}
SAMPLER_PREFIX = "sampler:"
_SAMPLER_PATH = re.compile(r"^tinker://(run_[A-Za-z0-9_-]{1,64})/sampler_weights/(.+)@(\d+)$")


def tinker_error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


def sampler_path(run_id: str, name: str, step: int) -> str:
    """The ``tinker://`` path of saved sampler weights: the run and the version it reached."""
    return f"tinker://{run_id}/sampler_weights/{name}@{step}"


def sampler_id(ref: ModelRef) -> str:
    """A new sampling session's id: what it samples, and a nonce of its own (a session's
    requests are told apart by their ``seq_id``, which every session counts from 0)."""
    what = "base" if ref.is_base else f"{ref.run_id}@{ref.min_version}"
    return f"{SAMPLER_PREFIX}{what}:{uuid.uuid4().hex[:12]}"


async def pin(gateway: Scope, ref: ModelRef) -> None:
    """Have inference keep ``ref``'s exact version (a one-token request pins it as a snapshot),
    so the sampler gets it after the run trains on; a version it cannot serve fails here."""
    if ref.exact:
        await gateway.backend.generate(
            ref, [[gateway.codec.bos_id]], n=1, max_tokens=1, temperature=0.0, top_p=1.0
        )


async def sampler_ref(gateway: Scope, session_id: str) -> ModelRef:
    """What a sampling session samples, read from its id."""
    name = session_id.removeprefix(SAMPLER_PREFIX).partition(":")[0]
    if not session_id.startswith(SAMPLER_PREFIX) or not name:
        raise GatewayError(404, f"unknown sampling session {session_id!r}")
    if name == "base":
        return await gateway.backend.resolve(gateway.settings.base_name())
    return await gateway.backend.resolve(name)  # run_x@<version>: checked as the OpenAI API does


async def model_path_ref(
    gateway: Scope, model_path: str | None, base_model: str | None
) -> ModelRef:
    if model_path:
        match = _SAMPLER_PATH.match(model_path)
        if match is None:
            raise GatewayError(
                400,
                f"model_path {model_path!r} is not sampler weights this gateway saved "
                "(tinker://<run>/sampler_weights/<name>@<step>, from save_weights_for_sampler)",
            )
        return await gateway.backend.resolve(f"{match.group(1)}@{match.group(3)}")
    return await gateway.backend.resolve(check_base(gateway, base_model))


def check_base(gateway: Scope, base_model: str | None) -> str:
    served = gateway.settings.base_name()
    if base_model not in (served, str(gateway.settings.model)):
        raise GatewayError(
            400, f"base model {base_model!r} is not served here; this deployment serves {served!r}"
        )
    return served


# --- set-up and sessions ----------------------------------------------------------------------


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    return CLIENT_CONFIG


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 3600, "sample_cancel_enabled": True}


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/telemetry")
async def telemetry(request: Request) -> dict[str, Any]:
    await read_json(request)
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    model = {"model_name": gateway.settings.base_name(), "trainable": True, "sampleable": True}
    return {"supported_models": [model]}


# --- sampling ---------------------------------------------------------------------------------


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(SamplingSessionBody, await read_json(request))
    ref = await model_path_ref(gateway, body.model_path, body.base_model)
    await pin(gateway, ref)
    session_id = sampler_id(ref)
    if body.session_id:
        gateway.sessions.touch(gateway.tenant, body.session_id).samplers.append(session_id)
    return {"type": "create_sampling_session", "sampling_session_id": session_id}


@router.get("/samplers/{session_id}")
async def get_sampler(request: Request, session_id: str) -> dict[str, Any]:
    gateway = gateway_of(request)
    ref = await sampler_ref(gateway, session_id)
    path = None if ref.is_base else sampler_path(ref.run_id, "weights", ref.min_version)
    return {
        "sampler_id": session_id,
        "base_model": gateway.settings.base_name(),
        "model_path": path,
    }


def _prompt_tokens(body: SampleBody) -> list[int]:
    tokens: list[int] = []
    for chunk in body.prompt.chunks:
        if chunk.type != "encoded_text":
            raise GatewayError(400, f"prompt chunks of type {chunk.type!r} are not supported")
        tokens.extend(chunk.tokens)
    if not tokens:
        raise GatewayError(400, "the prompt is empty")
    return tokens


def _stopped(ids: list[int], stops: list[Any], gateway: Scope) -> int:
    """How many tokens to keep: through the first stop token, or through the token that
    completes a stop string; ``len(ids)`` when none occurs."""
    stop_ids = {s for s in stops if isinstance(s, int)}
    texts = [s for s in stops if isinstance(s, str) and s]
    for k, token in enumerate(ids):
        if token in stop_ids:
            return k + 1
        if texts:
            text = gateway.codec.text(ids[: k + 1])
            if any(s in text for s in texts):
                return k + 1
    return len(ids)


async def _sample(
    gateway: Scope, ref: ModelRef, body: SampleBody, n: int, max_tokens: int, ticket: Ticket
) -> Outcome:
    """The samples of an ``asample`` request whose ``n`` and ``max_tokens`` were checked, under
    the ``ticket`` it was admitted with."""
    params = body.sampling_params
    prompt = _prompt_tokens(body)
    k_prompt, k_sample = body.topk_prompt_logprobs or 0, body.topk_sample_logprobs or 0
    scored = bool(body.prompt_logprobs) or k_prompt > 0
    answer = await gateway.backend.generate(
        ref,
        [prompt],
        n=n,
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        seed=params.seed,
        top_k=max(params.top_k, 0),
        top_logprobs=max(k_prompt if scored else 0, k_sample),
        prompt_logprobs=scored,
        ignore_eos=params.stop == [],
        ticket=ticket,
    )
    stops = params.stop
    stops = [stops] if isinstance(stops, str | int) else list(stops or [])
    sequences = []
    for c in answer.completions[0]:
        ids, logprobs = list(c.token_ids), list(c.logprobs)
        top = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in c.top_logprobs]
        reason: str = c.finish_reason
        keep = _stopped(ids, stops, gateway)
        if keep < len(ids):
            ids, logprobs, top, reason = ids[:keep], logprobs[:keep], top[:keep], "stop"
        sequences.append(wire.SampledSequence(ids, logprobs, reason, top if k_sample else None))
    scores, prompt_top = None, None
    if scored and answer.prompt_logprobs:
        given = answer.prompt_logprobs[0]
        scores = list(given.logprobs)
        prompt_top = [list(zip(t.token_ids, t.logprobs, strict=True)) for t in given.top_logprobs]
        last_n = body.prompt_logprobs_last_n
        if last_n is not None:  # positions before the last n are not scored
            cut = max(0, len(scores) - last_n)
            scores[:cut] = [None] * cut
            prompt_top[:cut] = [[] for _ in prompt_top[:cut]]
    return Outcome(
        proto=wire.encode_sample_response(
            sequences,
            prompt_logprobs=scores if body.prompt_logprobs else None,
            prompt_top=prompt_top,
            k_prompt=k_prompt,
            k_sample=k_sample,
        )
    )


def _sample_limits(gateway: Scope, body: SampleBody, prompt: list[int]) -> tuple[int, int]:
    """The number of samples and the token budget of a sample request, checked: without
    ``max_tokens``, as many as the model's context leaves after the prompt."""
    settings, context = gateway.settings, gateway.codec.context_len
    room = context - len(prompt)
    if room < 1:
        raise GatewayError(
            400,
            f"the prompt has {len(prompt)} tokens and fills the model's context of {context}; "
            "shorten it",
        )
    n = body.num_samples
    asked = body.sampling_params.max_tokens
    max_tokens = asked if asked is not None else min(room, settings.max_tokens)
    if not 1 <= n <= settings.max_samples or max_tokens > settings.max_tokens:
        raise GatewayError(
            400,
            f"num_samples must be 1..{settings.max_samples} and max_tokens at most "
            f"{settings.max_tokens}",
        )
    if max_tokens > room:
        raise GatewayError(
            400,
            f"a prompt of {len(prompt)} tokens plus max_tokens {max_tokens} exceeds the model's "
            f"context of {context} tokens; ask for at most {room} (or leave max_tokens unset)",
        )
    for name in ("target_prompt_logprobs", "prompt_alt_tokens_k"):
        if getattr(body, name):
            raise GatewayError(400, f"{name} is not supported by plexrl")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (body.prompt_logprobs and 1 <= last_n <= len(prompt) - 1):
        raise GatewayError(
            400, "prompt_logprobs_last_n needs prompt_logprobs and must be 1..len(prompt) - 1"
        )
    return n, max_tokens


@router.post("/asample")
async def asample(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    body = parse_body(SampleBody, await read_json(request))
    prompt = _prompt_tokens(body)
    try:
        gateway.codec.check_ids(prompt)
    except ValueError as exc:
        raise GatewayError(400, str(exc)) from exc
    n, max_tokens = _sample_limits(gateway, body, prompt)
    if body.sampling_session_id:
        session = body.sampling_session_id
        ref = await sampler_ref(gateway, session)
        seq = body.seq_id
        request_id = f"sample:{session}:{seq}" if seq is not None else f"sample:{uuid.uuid4().hex}"
    else:
        ref = await model_path_ref(gateway, body.model_path, body.base_model)
        request_id = f"sample:{uuid.uuid4().hex}"
    note_run(request, ref.run_id)
    # Admitted now or refused now (429): a sample's future never waits for room.
    gateway.backend.check_work(1, n, max_tokens)
    ticket = gateway.backend.admission.admit(1, n, max_tokens)
    try:
        future_id = gateway.futures.start(
            request_id,
            lambda: _sample(gateway, ref, body, n, max_tokens, ticket),
            on_done=ticket.release,
        )
    except GatewayError:  # the key's own limit: no future, so nothing holds the ticket
        ticket.release()
        raise
    return {
        "request_id": future_id,
        "sample_sequence_ids": [f"{future_id}/{i}" for i in range(n)],
    }


# --- futures ----------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    gateway = gateway_of(request)
    request_id = parse_body(FutureBody, await read_json(request)).request_id
    try:
        outcome = await gateway.futures.wait(request_id, gateway.settings.poll_s)
    except KeyError:
        raise GatewayError(
            404,
            f"unknown request {request_id!r}: it finished more than {gateway.settings.future_ttl_s:g}s "
            "ago, or this gateway restarted since; send the request again",
        ) from None
    if outcome is None:
        return JSONResponse(
            {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        )
    if outcome.error is not None:
        return JSONResponse({"error": outcome.error, "category": outcome.category})
    if outcome.proto is not None:
        return Response(outcome.proto, media_type=wire.PROTOBUF)
    return JSONResponse(outcome.body or {})


@router.post("/cancel_future")
async def cancel_future(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    request_id = parse_body(FutureBody, await read_json(request)).request_id
    if not request_id.startswith("sample-"):
        if gateway.futures.known(request_id):
            raise GatewayError(
                400,
                f"{request_id} cannot be cancelled: only samples can; a training request "
                "already sent to the trainer is applied",
            )
        raise GatewayError(404, f"unknown request {request_id!r}")
    if not gateway.futures.cancel(request_id):
        raise GatewayError(404, f"unknown request {request_id!r}")
    return {}
