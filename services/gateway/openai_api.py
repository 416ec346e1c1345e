"""The OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

``model`` names a run: ``run_x`` is the newest adapter inference holds for it, ``run_x@12``
exactly version 12 (a snapshot the replica keeps, or a 400 saying why it cannot), the base
model's name (``/v1/models`` lists it) the base model, which needs no run. Every completion comes
from one ``GenerateRequest`` to inference; a streamed response sends it token by token as
server-sent events once inference has answered, with a last chunk of usage when
``stream_options.include_usage`` asks for it. Log-probabilities are those of the sampled tokens
under the distribution they were sampled from, with the ``logprobs`` / ``top_logprobs`` most
likely alternatives; ``echo`` scores the prompt too (temperature 1: the model's own). ``stop``
strings end a completion where they first appear, as OpenAI does. Parameters plexrl does not
implement are refused by name (:mod:`services.gateway.openai_params`).

Errors are OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status the official clients map to their exceptions (400, 404, 413, 503...); past the
gateway's or a replica's bound on generation under way, a 429 with ``Retry-After`` (which the
official clients wait out and retry). A client that disconnects before its answer has its
generation cancelled, in inference too.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from schemas.events import Completion, GenerateResponse, TopLogprobs
from services.gateway.app import Scope, gateway_of, parse_body, read_json, while_connected
from services.gateway.backend import RUN_ID, GatewayError
from services.gateway.observe import note_run
from services.gateway.openai_params import ChatRequest, CompletionRequest, Sampling
from services.gateway.text import TextCodec

router = APIRouter(prefix="/v1")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    429: "rate_limit_exceeded",
    404: "invalid_request_error",
    413: "invalid_request_error",
}


def openai_error(status: int, message: str, code: str | None = None) -> JSONResponse:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def _limits(gateway: Scope, max_tokens: int | None, n: int, default: int) -> int:
    settings = gateway.settings
    tokens = default if max_tokens is None else max_tokens
    if tokens > settings.max_tokens:
        raise GatewayError(
            400, f"max_tokens {tokens} is over this gateway's limit of {settings.max_tokens}"
        )
    if n > settings.max_samples:
        raise GatewayError(400, f"n {n} is over this gateway's limit of {settings.max_samples}")
    return tokens


class _Choice:
    """One completion after stop strings: its token ids, logprobs, alternatives, text and
    finish reason."""

    def __init__(self, codec: TextCodec, completion: Completion, stops: list[str]) -> None:
        ids, logprobs = list(completion.token_ids), list(completion.logprobs)
        top = list(completion.top_logprobs)
        self.finish_reason: str = completion.finish_reason
        text = codec.text(ids)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            keep = len(ids)
            while keep > 0 and len(codec.text(ids[: keep - 1])) >= cut:
                keep -= 1
            ids, logprobs, top, text = ids[:keep], logprobs[:keep], top[:keep], text[:cut]
            self.finish_reason = "stop"
        self.ids, self.logprobs, self.top, self.text = ids, logprobs, top, text


async def _generate(
    request: Request, req: Sampling, prompts: list[list[int]], max_tokens: int, **scores: Any
) -> GenerateResponse:
    gateway = gateway_of(request)
    req.refuse_the_unimplemented()
    ref = await gateway.backend.resolve(req.model)
    note_run(request, ref.run_id)
    for ids in prompts:
        if not ids:
            raise GatewayError(400, "a prompt is empty: send at least one token or character")
        try:
            gateway.codec.check_ids(ids)
        except ValueError as exc:
            raise GatewayError(400, str(exc)) from exc
        if len(ids) + max_tokens > gateway.codec.context_len:
            raise GatewayError(
                400,
                f"a prompt of {len(ids)} tokens plus max_tokens {max_tokens} exceeds the model's "
                f"context of {gateway.codec.context_len} tokens",
            )
    generation = gateway.backend.generate(
        ref,
        prompts,
        n=req.n,
        max_tokens=max(max_tokens, 1),
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        top_k=max(req.top_k, 0),
        **scores,
    )
    return await while_connected(request, generation)


def _usage(prompts: list[list[int]], choices: list[_Choice]) -> dict[str, int]:
    used = sum(len(p) for p in prompts)
    made = sum(len(c.ids) for c in choices)
    return {"prompt_tokens": used, "completion_tokens": made, "total_tokens": used + made}


def _sse(chunks: list[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _prompt_ids(codec: TextCodec, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [codec.prompt_ids(prompt)]
    if prompt and all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [codec.prompt_ids(p) if isinstance(p, str) else list(p) for p in prompt]


def _alternatives(codec: TextCodec, top: TopLogprobs) -> dict[str, float]:
    texts = codec.token_texts(top.token_ids)
    return dict(zip(texts, top.logprobs, strict=True))


def _completion_logprobs(
    codec: TextCodec,
    ids: list[int],
    logprobs: list[float | None],
    top: list[TopLogprobs | None] | None,
) -> dict[str, Any]:
    tokens = codec.token_texts(ids)
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    alternatives = None
    if top is not None:
        alternatives = [None if t is None else _alternatives(codec, t) for t in top]
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": alternatives,
        "text_offset": offsets,
    }


def _model_json(model_id: str, created: int, owner: str) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owner}


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    models = [_model_json(gateway.settings.base_name(), 0, "plexrl")]
    for row in await gateway.backend.runs():
        if row.status == "active" and row.tenant == gateway.backend.tenant:
            models.append(_model_json(row.run_id, int(row.updated_at), row.tenant))
    return {"object": "list", "data": models}


@router.get("/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> dict[str, Any]:
    gateway = gateway_of(request)
    if model == gateway.settings.base_name():
        return _model_json(model, 0, "plexrl")
    run_id = model.partition("@")[0]
    row = await gateway.backend.run(run_id) if RUN_ID.match(run_id) else None
    if row is None or row.status != "active" or row.tenant != gateway.backend.tenant:
        raise GatewayError(404, f"model {model!r} does not exist", "model_not_found")
    await gateway.backend.resolve(model)  # run_x@N: a version it published
    return _model_json(model, int(row.updated_at), row.tenant)


@router.post("/completions")
async def completions(request: Request) -> Response:
    gateway = gateway_of(request)
    req: CompletionRequest = parse_body(CompletionRequest, await read_json(request))
    max_tokens = _limits(gateway, req.max_tokens, req.n, 16)
    if max_tokens == 0 and not req.echo:
        raise GatewayError(400, "max_tokens 0 generates nothing: it takes echo = true")
    k = req.logprobs or 0
    prompts = _prompt_ids(gateway.codec, req.prompt)
    answer = await _generate(
        request, req, prompts, max_tokens, top_logprobs=k, prompt_logprobs=req.echo
    )
    groups = answer.completions
    choices = [_Choice(gateway.codec, c, req.stops()) for group in groups for c in group]
    if max_tokens == 0:  # scoring the prompt alone (echo): nothing generated
        for c in choices:
            c.ids, c.logprobs, c.top, c.text, c.finish_reason = [], [], [], "", "length"
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}
    wants = req.logprobs is not None

    def choice(i: int, text: str, ids: slice, c: _Choice, end: str | None) -> dict[str, Any]:
        lp = None
        if wants:
            top: list[TopLogprobs | None] | None = list(c.top[ids]) if k else None
            lp = _completion_logprobs(gateway.codec, c.ids[ids], list(c.logprobs[ids]), top)
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": end}

    def echoed(i: int, c: _Choice) -> dict[str, Any]:
        prompt = prompts[i // req.n]
        scores = answer.prompt_logprobs[i // req.n]
        text = gateway.codec.text(prompt) + c.text
        lp = None
        if wants:
            top = None
            if k:
                top = [None, *scores.top_logprobs[1:], *c.top]
            lp = _completion_logprobs(
                gateway.codec, prompt + c.ids, [*scores.logprobs, *c.logprobs], top
            )
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

    if not req.stream:
        if req.echo:
            body = [echoed(i, c) for i, c in enumerate(choices)]
        else:
            body = [
                choice(i, c.text, slice(None), c, c.finish_reason) for i, c in enumerate(choices)
            ]
        return JSONResponse({**head, "choices": body, "usage": _usage(prompts, choices)})
    if req.echo:
        raise GatewayError(400, "echo is not supported with stream = true")
    chunks = []
    for i, c in enumerate(choices):
        pieces = _pieces(gateway.codec, c)
        for j, piece in enumerate(pieces):
            end = c.finish_reason if j == len(pieces) - 1 else None
            chunks.append({**head, "choices": [choice(i, piece, slice(j, j + 1), c, end)]})
    if req.include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(prompts, choices)})
    return _sse(chunks)


def _pieces(codec: TextCodec, choice: _Choice) -> list[str]:
    """The completion's text split at token boundaries (at least one piece, maybe empty), each
    piece the text the token added, so the pieces join to the text exactly."""
    pieces, before = [], ""
    for k in range(1, len(choice.ids) + 1):
        now = codec.text(choice.ids[:k])[: len(choice.text)]
        pieces.append(now[len(before) :])
        before = now
    if not pieces:
        return [choice.text]
    pieces[-1] += choice.text[len(before) :]
    return pieces


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    gateway = gateway_of(request)
    req: ChatRequest = parse_body(ChatRequest, await read_json(request))
    k = req.check_logprobs()
    messages = [
        {"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(req.messages)
    ]
    prompts = [gateway.codec.chat_ids(messages)]
    room = max(gateway.codec.context_len - len(prompts[0]), 1)
    default = min(room, gateway.settings.max_tokens)  # OpenAI's: up to the context left
    max_tokens = _limits(gateway, req.max_completion_tokens or req.max_tokens, req.n, default)
    if max_tokens == 0:
        raise GatewayError(400, "max_tokens must be at least 1")
    answer = await _generate(request, req, prompts, max_tokens, top_logprobs=k)
    choices = [_Choice(gateway.codec, c, req.stops()) for c in answer.completions[0]]
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def content_logprobs(c: _Choice, ids: slice) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        tokens = gateway.codec.token_texts(c.ids[ids])
        tops = c.top[ids] if k else [None] * len(tokens)
        content = []
        for t, lp, top in zip(tokens, c.logprobs[ids], tops, strict=True):
            alternatives = []
            if top is not None:
                texts = gateway.codec.token_texts(top.token_ids)
                alternatives = [entry(a, v) for a, v in zip(texts, top.logprobs, strict=True)]
            content.append(entry(t, lp) | {"top_logprobs": alternatives})
        return {"content": content}

    if not req.stream:
        head = {"id": cid, "object": "chat.completion", "created": created, "model": req.model}
        body = [
            {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": content_logprobs(c, slice(None)),
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ]
        return JSONResponse({**head, "choices": body, "usage": _usage(prompts, choices)})
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": req.model}
    chunks: list[dict[str, Any]] = []
    for i, c in enumerate(choices):
        first = {
            "index": i,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunks.append({**head, "choices": [first]})
        pieces = _pieces(gateway.codec, c)
        for j, piece in enumerate(pieces):
            end: Literal["stop", "length"] | None = None
            if j == len(pieces) - 1:
                end = "stop" if c.finish_reason == "stop" else "length"
            delta = {
                "index": i,
                "delta": {"content": piece},
                "logprobs": content_logprobs(c, slice(j, j + 1)) if j < len(c.ids) else None,
                "finish_reason": end,
            }
            chunks.append({**head, "choices": [delta]})
    if req.include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(prompts, choices)})
    return _sse(chunks)
