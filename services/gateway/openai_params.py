"""The OpenAI API's request bodies: what plexrl honours, and a 400 for the rest.

Every parameter of a completion or chat request is either honoured or refused with a 400 that
names it, never silently ignored: a client that asks for penalties, a logit bias, tools, a JSON
response format, ``best_of`` or images and gets plain sampling instead would be misled. A
parameter sent with its neutral value (``null``, ``presence_penalty: 0``, ``best_of: 1``,
``response_format: {"type": "text"}``...) asks for nothing and is accepted.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from schemas.events import MAX_TOP_LOGPROBS
from services.gateway.backend import GatewayError

NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "response_format": ({"type": "text"},),
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "store": (False,),
    "modalities": (["text"],),
}
"""the values of OpenAI parameters plexrl does not implement that ask for nothing"""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class Sampling(BaseModel):
    """What the two generation routes share (see the module docstring for the rest)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1, le=1_000_000)
    """not OpenAI's; vLLM-compatible servers take it too (``extra_body``)"""
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def refuse_the_unimplemented(self) -> None:
        """A 400 naming the first parameter plexrl would otherwise ignore."""
        for name, value in (self.model_extra or {}).items():
            if value is None or value in NEUTRAL.get(name, ()):
                continue
            raise GatewayError(
                400,
                f"parameter {name!r} is not supported by plexrl (it would be ignored); leave it "
                "out" + (f" or send {NEUTRAL[name][0]!r}" if name in NEUTRAL else ""),
                "unsupported_parameter",
            )
        if self.stream_options is not None and not self.stream:
            raise GatewayError(400, "stream_options applies to stream = true only")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self, where: str) -> str:
        for name in ("tool_calls", "function_call", "audio"):
            if (self.model_extra or {}).get(name):
                raise GatewayError(
                    400, f"{where}.{name}: tool and audio messages are not supported"
                )
        if not isinstance(self.content, list):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text":
                raise GatewayError(
                    400,
                    f"{where}.content[{j}] is of type {part.get('type')!r}: plexrl serves text "
                    "models; send text parts only",
                    "unsupported_parameter",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)

    def check_logprobs(self) -> int:
        """The alternatives asked for per token (a 400 for top_logprobs without logprobs)."""
        if self.top_logprobs and not self.logprobs:
            raise GatewayError(400, "top_logprobs needs logprobs = true")
        return self.top_logprobs or 0
