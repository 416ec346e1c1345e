"""The edges of a generate request: the checks it must pass, and the reply that answers it.

Decoding already enforces the schema (types, bounds, the run-id pattern). What only this
replica can judge is checked here: token ids inside the model's vocabulary, prompts that are
not empty, prompt plus completion within the model's context, a bounded amount of work
(``max_request_tokens``: one tenant's request cannot hold a replica for hours), and a
``progress_subject`` that is
an inbox of the requester's tenant (a replica publishes nowhere else). A request that fails is
malformed: it gets an error reply and an InvalidMessage report.

A reply goes to the request's reply subject in the request's own encoding (MessagePack when it
came as MessagePack), with the trace context and the ``Plexrl-Replica`` header naming the
replica that answered. A response too big for the server's ``max_payload`` becomes an error
reply that says so.
"""

from __future__ import annotations

import secrets

from nats.aio.client import Client as NATS

from schemas.codec import Format, content_type, encode, is_msgpack
from schemas.events import GenerateRequest, GenerateResponse
from schemas.tenant import check_progress_subject
from services.bus import tracing

REPLICA_HEADER = "Plexrl-Replica"


class RequestFailed(Exception):
    """A request that cannot be served; the message is the error the reply carries."""


class WrongTenant(RequestFailed):
    """A request on a tenant's subject for a run of another tenant."""


def check_request(
    req: GenerateRequest, vocab_size: int, max_model_len: int, max_request_tokens: int = 1 << 62
) -> None:
    """Raise :class:`RequestFailed` saying what is wrong with ``req`` for this model, or when
    it asks for more than ``max_request_tokens`` tokens (prompts x n x max_tokens)."""
    work = len(req.prompts) * req.n * req.max_tokens
    if work > max_request_tokens:
        raise RequestFailed(
            f"prompts x n x max_tokens = {len(req.prompts)} x {req.n} x {req.max_tokens} = "
            f"{work} tokens, over this replica's limit of {max_request_tokens} per request "
            "(max_request_tokens): split it into several requests"
        )
    for i, prompt in enumerate(req.prompts):
        if not prompt:
            raise RequestFailed(
                f"prompts[{i}] is empty: a prompt needs at least one token (start it with <bos>)"
            )
        too_big = next((t for t in prompt if t >= vocab_size), None)
        if too_big is not None:
            raise RequestFailed(
                f"prompts[{i}] holds token id {too_big}, outside the model's vocabulary of "
                f"{vocab_size} tokens (ids 0..{vocab_size - 1}): was it tokenized for another "
                "model?"
            )
        if len(prompt) + req.max_tokens > max_model_len:
            raise RequestFailed(
                f"prompts[{i}] has {len(prompt)} tokens; with max_tokens {req.max_tokens} it "
                f"exceeds the model's context of {max_model_len} tokens"
            )


def check_progress(req: GenerateRequest, tenant: str) -> None:
    """Raise :class:`RequestFailed` unless ``req.progress_subject`` is absent or an inbox of
    ``tenant`` (see :func:`schemas.tenant.check_progress_subject`)."""
    if req.progress_subject is not None:
        try:
            check_progress_subject(req.progress_subject, tenant)
        except ValueError as exc:
            raise RequestFailed(str(exc)) from None


def request_format(request_headers: dict[str, str]) -> Format:
    """The encoding of a request, which its reply and its progress messages use too."""
    return "msgpack" if is_msgpack(request_headers.get("Content-Type")) else "json"


def request_seed(seed: int | None) -> int:
    """The request's seed, or a fresh random one when it gave none."""
    return secrets.randbits(63) if seed is None else seed


def failure(
    request_id: str,
    run_id: str,
    error: str,
    code: str | None = None,
    retry_after_s: float | None = None,
) -> GenerateResponse:
    """The error reply: no completions, ``error`` saying why (``code`` for a machine)."""
    return GenerateResponse(
        request_id=request_id,
        run_id=run_id,
        policy_version=0,
        completions=[],
        error=error,
        error_code=code,
        retry_after_s=retry_after_s,
    )


async def send_reply(
    nc: NATS,
    reply_subject: str,
    response: GenerateResponse,
    request_headers: dict[str, str],
    replica_name: str,
) -> None:
    """Publish ``response`` to the requester's inbox, encoded as the request was."""
    fmt = request_format(request_headers)
    data = encode(response, fmt)
    limit = nc.max_payload or 0
    if limit and len(data) > limit:
        data = encode(
            failure(
                response.request_id,
                response.run_id,
                f"the response is {len(data)} bytes, over the server's max_payload of {limit}: "
                "ask for fewer prompts, completions or tokens per request",
            ),
            fmt,
        )
    headers = tracing.inject({"Content-Type": content_type(fmt), REPLICA_HEADER: replica_name})
    await nc.publish(reply_subject, data, headers=headers)
