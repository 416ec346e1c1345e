"""Generation: GenerateRequest in, GenerateResponse out (request/reply, queue group ``inference``).

A request says where it comes from (``source``): an RL run's rollouts (``rollout``, the default,
and what every request before the field was) or HTTP sampling through the gateway (``http``). A
replica schedules rollouts ahead of HTTP sampling, gives HTTP sampling a bounded share of its
batch, and refuses HTTP sampling past its bound at once (``error_code = "overloaded"``), never
queueing it without limit. A request may carry a ``deadline``; a requester that gives up early
says so with a GenerateCancel, and the replica holding the request drops it (queued) or stops it
(generating), freeing its batch slots.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from schemas.events import Event, FinishReason, NonNegInt, RunId, TokenId

MAX_TOP_LOGPROBS = 20
"""the most alternatives a GenerateRequest may ask for per position (``top_logprobs``)"""

RequestSource = Literal["rollout", "http"]
"""Where a generate request comes from: an RL run's rollouts, or HTTP sampling (the gateway)."""

ErrorCode = Annotated[
    str,
    msgspec.Meta(
        max_length=64,
        description="why a GenerateResponse failed, for a machine: 'overloaded' (the replica is "
        "at its bound for HTTP sampling: retry after retry_after_s), 'deadline_exceeded' (the "
        "request's deadline passed), 'cancelled' (its requester cancelled it); readers treat a "
        "code they do not know as a plain error",
    ),
]


class GenerateRequest(Event, frozen=True, kw_only=True, tag="generate_request"):
    """Completions for ``prompts`` under ``run_id``'s adapter, ``n`` per prompt.

    Producer: orchestrator (or any client). Consumer: an inference replica.
    Subject: ``plexrl.inference.generate`` (request/reply). The reply is a GenerateResponse
    generated with a policy version ``>= min_policy_version`` (exactly that version with
    ``exact_version``), or an error.

    ``progress_subject`` asks for liveness: the replica that takes the request publishes a
    GenerateProgress there at once and then every ``progress_every_s`` seconds until it replies,
    so a requester can tell a replica that died holding the request from one that is still
    waiting or generating. It must be an inbox of the requester: a subject under ``_INBOX.``
    (``_INBOX_<tenant>.`` on a tenant's generate subject); a replica refuses any other with an
    error reply. Absent (every request before the field existed), no progress is sent. The reply
    itself always travels on the request's NATS reply subject.
    """

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    run_id: RunId
    prompts: Annotated[list[list[TokenId]], msgspec.Meta(min_length=1)]
    n: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 16
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    min_policy_version: NonNegInt = 0
    seed: int | None = None
    timeout_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)] = 30.0
    progress_subject: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    progress_every_s: Annotated[float, msgspec.Meta(ge=0.1, le=60.0)] = 2.0
    prompt_logprobs: bool = False
    """also score each prompt's tokens (temperature 1, no filter: the trainer's forward)"""
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    """the most likely tokens to report at each sampled (and scored prompt) position"""
    top_k: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    """sample among the ``top_k`` most likely tokens only (0: no limit); before top_p"""
    ignore_eos: bool = False
    """do not stop at an end-of-sequence token: generate ``max_tokens`` tokens"""
    exact_version: bool = False
    """serve ``min_policy_version`` exactly (a snapshot), or an error saying why not"""
    base_model: bool = False
    """generate with the base model, no adapter: ``run_id`` is only a label, no run needed"""
    deadline: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
    """unix time (seconds) after which the requester no longer wants the answer: a replica
    drops the request, queued or generating, and answers ``deadline_exceeded``. None (every
    request before the field): no deadline but ``timeout_s`` for its policy version"""
    source: RequestSource = "rollout"
    """who asks: ``rollout`` (an RL run's orchestrator) or ``http`` (HTTP sampling through the
    gateway). Absent means ``rollout``: a request from before the field came from an
    orchestrator or a gateway that never heard of the bound, and refusing or delaying an old
    orchestrator's rollouts would stall its training, while an old gateway's traffic is served
    as it was before"""


class TopLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """The most likely tokens at one position, most likely first, and their log-probabilities."""

    token_ids: list[TokenId]
    logprobs: list[float]


class PromptLogprobs(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt's scores: ``logprobs[t]`` is the log-probability of prompt token ``t`` after
    the tokens before it (``None`` for the first, which has no context); ``top_logprobs[t]`` the
    alternatives at position ``t`` (empty for the first) when the request asked for them."""

    logprobs: list[float | None]
    top_logprobs: list[TopLogprobs] = msgspec.field(default_factory=list)


ProgressState = Literal["waiting_for_version", "generating"]
"""What a replica is doing with a request: waiting until it can serve the request's
``min_policy_version``, or generating (queued in or running a batch)."""


class GenerateProgress(Event, frozen=True, kw_only=True, tag="generate_progress"):
    """A replica still holds a GenerateRequest: a liveness message, not a result.

    Producer: the inference replica that took a request naming a ``progress_subject``.
    Consumer: the requester. Subject: the request's ``progress_subject`` (core NATS, no stream).
    Sent when the replica takes the request, when its state changes and every
    ``progress_every_s`` seconds until the reply is sent; ``seq`` counts them from 0. When they
    stop and no reply came, the replica is gone: the requester may send the request again
    without waiting for its own timeout.
    """

    request_id: str
    run_id: str
    replica: str
    state: ProgressState
    seq: NonNegInt = 0


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """One sampled completion: token ids, the log-probability of each under the distribution it
    was sampled from, and why it ended."""

    token_ids: list[TokenId]
    logprobs: list[float]
    finish_reason: FinishReason
    top_logprobs: list[TopLogprobs] = msgspec.field(default_factory=list)
    """per sampled token, the request's ``top_logprobs`` most likely tokens (empty when it asked
    for none)"""


class GenerateResponse(Event, frozen=True, kw_only=True, tag="generate_response"):
    """The reply to a GenerateRequest.

    Producer: inference. Consumer: the requester.
    ``completions[i]`` holds the ``n`` completions of ``prompts[i]``. On failure ``completions``
    is empty and ``error`` says why.
    """

    request_id: str
    run_id: str
    policy_version: NonNegInt
    completions: list[list[Completion]]
    error: str | None = None
    prompt_logprobs: list[PromptLogprobs] = msgspec.field(default_factory=list)
    """``prompt_logprobs[i]`` scores ``prompts[i]`` when the request asked for
    ``prompt_logprobs`` (empty otherwise)"""
    error_code: ErrorCode | None = None
    """with ``error``: a machine-readable reason when there is one (None from replicas before
    the field, and for errors ``error`` alone explains)"""
    retry_after_s: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
    """with ``error_code = "overloaded"``: when to try again, in seconds"""


class GenerateCancel(Event, frozen=True, kw_only=True, tag="generate_cancel"):
    """The requester of a GenerateRequest no longer wants its answer (its HTTP client left, a
    Tinker sample was cancelled).

    Producer: the requester (the gateway). Consumer: every inference replica; the one holding
    ``request_id`` drops it if it is queued or stops it if it is generating, frees its batch
    slots and answers ``error_code = "cancelled"``. Subject: ``plexrl.inference.cancel``
    (``plexrl.inference.<tenant>.cancel`` for a tenant's requests: a cancel reaches only
    requests sent on the same tenant's generate subject). Core NATS, no reply.
    """

    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""
