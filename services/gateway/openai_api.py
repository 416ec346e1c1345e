"""The OpenAI-compatible API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

``model`` names a run: ``run_x`` is the newest adapter inference holds for it, ``run_x@12`` a
version of at least 12, the base model's name (``/v1/models`` lists it) the base model. Every
completion comes from one ``GenerateRequest`` to inference; a streamed response sends it token
by token as server-sent events once inference has answered. Log-probabilities are those of the
sampled tokens under the distribution they were sampled from (no alternatives: ``top_logprobs``
is empty). ``stop`` strings end a completion where they first appear, as OpenAI does.

Errors are OpenAI's JSON: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status the official clients map to their exceptions (400, 404, 413, 503...).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from schemas.events import Completion
from services.gateway.app import Scope, gateway_of, parse_body, read_json
from services.gateway.backend import GatewayError, ModelRef
from services.gateway.observe import note_run
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


class _Sampling(BaseModel):
    """What the two generation routes share. Unknown fields are accepted and ignored, as
    OpenAI-compatible servers do with parameters they do not implement."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_completion_tokens: int | None = Field(None, ge=1)


def _limits(gateway: Scope, max_tokens: int | None, n: int) -> int:
    settings = gateway.settings
    tokens = 16 if max_tokens is None else max_tokens
    if tokens > settings.max_tokens:
        raise GatewayError(
            400, f"max_tokens {tokens} is over this gateway's limit of {settings.max_tokens}"
        )
    if n > settings.max_samples:
        raise GatewayError(400, f"n {n} is over this gateway's limit of {settings.max_samples}")
    return tokens


class _Choice:
    """One completion after stop strings: its token ids, logprobs, text and finish reason."""

    def __init__(self, codec: TextCodec, completion: Completion, stops: list[str]) -> None:
        ids, logprobs = list(completion.token_ids), list(completion.logprobs)
        self.finish_reason: str = completion.finish_reason
        text = codec.text(ids)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            keep = len(ids)
            while keep > 0 and len(codec.text(ids[: keep - 1])) >= cut:
                keep -= 1
            ids, logprobs, text = ids[:keep], logprobs[:keep], text[:cut]
            self.finish_reason = "stop"
        self.ids, self.logprobs, self.text = ids, logprobs, text


async def _generate(
    request: Request, req: _Sampling, prompts: list[list[int]], max_tokens: int
) -> tuple[ModelRef, list[list[Completion]]]:
    gateway = gateway_of(request)
    ref = await gateway.backend.resolve(req.model)
    note_run(request, ref.run_id)
    for ids in prompts:
        if not ids:
            raise GatewayError(400, "a prompt is empty: send at least one token or character")
        try:
            gateway.codec.check_ids(ids)
        except ValueError as exc:
            raise GatewayError(400, str(exc)) from exc
    answer = await gateway.backend.generate(
        ref,
        prompts,
        n=req.n,
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
    )
    return ref, answer.completions


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


def _completion_logprobs(codec: TextCodec, ids: list[int], logprobs: list[float]) -> dict[str, Any]:
    tokens = codec.token_texts(ids)
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": None,
        "text_offset": offsets,
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    gateway = gateway_of(request)
    base = gateway.backend.base_run_id
    models = [
        {"id": gateway.settings.base_name(), "object": "model", "created": 0, "owned_by": "plexrl"}
    ]
    for row in await gateway.backend.runs():
        if row.status == "active" and row.run_id != base and row.tenant == gateway.backend.tenant:
            created = int(row.updated_at)
            models.append(
                {"id": row.run_id, "object": "model", "created": created, "owned_by": row.tenant}
            )
    return {"object": "list", "data": models}


@router.post("/completions")
async def completions(request: Request) -> Response:
    gateway = gateway_of(request)
    req: CompletionRequest = parse_body(CompletionRequest, await read_json(request))
    if req.echo:
        raise GatewayError(400, "echo is not supported: the prompt is not scored")
    max_tokens = _limits(gateway, req.max_tokens, req.n)
    prompts = _prompt_ids(gateway.codec, req.prompt)
    _, groups = await _generate(request, req, prompts, max_tokens)
    choices = [_Choice(gateway.codec, c, req.stops()) for group in groups for c in group]
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}
    wants_logprobs = req.logprobs is not None

    def choice(i: int, text: str, ids: slice, c: _Choice, end: str | None) -> dict[str, Any]:
        lp = None
        if wants_logprobs:
            lp = _completion_logprobs(gateway.codec, c.ids[ids], c.logprobs[ids])
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": end}

    if not req.stream:
        body = [choice(i, c.text, slice(None), c, c.finish_reason) for i, c in enumerate(choices)]
        return JSONResponse({**head, "choices": body, "usage": _usage(prompts, choices)})
    chunks = []
    for i, c in enumerate(choices):
        pieces = _pieces(gateway.codec, c)
        for k, piece in enumerate(pieces):
            end = c.finish_reason if k == len(pieces) - 1 else None
            chunks.append({**head, "choices": [choice(i, piece, slice(k, k + 1), c, end)]})
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
    max_tokens = _limits(gateway, req.max_completion_tokens or req.max_tokens, req.n)
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    prompts = [gateway.codec.chat_ids(messages)]
    _, groups = await _generate(request, req, prompts, max_tokens)
    choices = [_Choice(gateway.codec, c, req.stops()) for c in groups[0]]
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def content_logprobs(c: _Choice, ids: slice) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        tokens = gateway.codec.token_texts(c.ids[ids])
        return {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, c.logprobs[ids], strict=True)
            ]
        }

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
        for k, piece in enumerate(pieces):
            end: Literal["stop", "length"] | None = None
            if k == len(pieces) - 1:
                end = "stop" if c.finish_reason == "stop" else "length"
            delta = {
                "index": i,
                "delta": {"content": piece},
                "logprobs": content_logprobs(c, slice(k, k + 1)) if k < len(c.ids) else None,
                "finish_reason": end,
            }
            chunks.append({**head, "choices": [delta]})
    return _sse(chunks)
