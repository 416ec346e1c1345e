"""What a replica takes on: its bound on HTTP sampling, and the requests it may be asked to drop.

- HTTP sampling (``source = "http"``) counts against ``max_http_requests`` requests and
  ``max_http_tokens`` tokens (every sequence's prompt plus ``max_tokens``: what the KV cache
  holds of it at its longest) held at once, waiting or generating. Past either bound a request
  is answered at once with ``error_code = "overloaded"`` and ``retry_after_s``, which the
  gateway turns into a 429 with ``Retry-After``: a replica never queues public traffic without
  limit. Rollouts (``source = "rollout"``) are never refused by the bound, so an RL run's
  progress does not depend on public traffic.
- Every request held here is known by its tenant and ``request_id`` (:class:`Held`), so a
  GenerateCancel on that tenant's cancel subject finds it and stops it.
- Requests dropped before their end are counted by reason (``plexrl_generate_dropped_total``):
  ``deadline`` (its deadline passed), ``cancelled`` (its requester cancelled it) and
  ``overloaded`` (refused at arrival by the bound).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from nats.aio.msg import Msg

from schemas import subjects as sj
from schemas.codec import DecodeError, decode
from schemas.events import GenerateCancel, GenerateRequest, GenerateResponse
from services.bus import Bus
from services.inference.jobs import DeadlineExceeded
from services.inference.requests import RequestFailed, failure
from services.telemetry.metrics import record_generate_dropped

log = logging.getLogger(__name__)

T = TypeVar("T")


class Overloaded(RequestFailed):
    """HTTP sampling past this replica's bound; ``retry_after_s`` says when to try again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def request_tokens(req: GenerateRequest) -> int:
    """What a request may hold in the KV cache at its longest: prompts plus completions."""
    return req.n * sum(len(p) + req.max_tokens for p in req.prompts)


def past_deadline(req: GenerateRequest) -> bool:
    return req.deadline is not None and req.deadline <= time.time()


def wait_limit(req: GenerateRequest) -> float:
    """How long ``req`` may wait for its policy version: ``timeout_s``, and never past its
    deadline (the requester's clock: unix time)."""
    if req.deadline is None:
        return req.timeout_s
    return min(req.timeout_s, req.deadline - time.time())


class HttpBound:
    """The HTTP sampling a replica holds now, against its bound (see the module docstring)."""

    def __init__(self, max_requests: int, max_tokens: int, retry_after_s: float) -> None:
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.retry_after_s = retry_after_s
        self.requests = 0
        self.tokens = 0

    def take(self, req: GenerateRequest) -> int:
        """Count ``req`` in (its tokens, to give back); :class:`Overloaded` past the bound.
        A rollout counts for nothing and is never refused."""
        if req.source != "http":
            return 0
        tokens = request_tokens(req)
        if self.requests >= self.max_requests or (
            self.requests and self.tokens + tokens > self.max_tokens
        ):
            raise Overloaded(
                f"this inference replica holds {self.requests} HTTP sampling requests of "
                f"{self.tokens} tokens, its bound (max_http_requests = {self.max_requests}, "
                f"max_http_tokens = {self.max_tokens}); try again in {self.retry_after_s:g}s",
                self.retry_after_s,
            )
        self.requests += 1
        self.tokens += tokens
        return tokens

    def give_back(self, req: GenerateRequest, tokens: int) -> None:
        if req.source == "http":
            self.requests -= 1
            self.tokens -= tokens


class Held:
    """The requests a replica holds, by tenant and request id, and what was dropped."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._tasks: dict[tuple[str, str], asyncio.Task[Any]] = {}
        self.cancelled: set[asyncio.Task[Any]] = set()
        self.dropped: Counter[str] = Counter()
        """requests dropped before their end, by reason (as the metric counts them)"""

    def add(self, tenant: str, request_id: str, task: asyncio.Task[Any]) -> None:
        self._tasks[(tenant, request_id)] = task

    def discard(self, tenant: str, request_id: str, task: asyncio.Task[Any]) -> None:
        if self._tasks.get((tenant, request_id)) is task:
            del self._tasks[(tenant, request_id)]
        self.cancelled.discard(task)

    def cancel(self, tenant: str, request_id: str) -> bool:
        """Stop ``tenant``'s request ``request_id`` if it is held here; whether it was."""
        task = self._tasks.get((tenant, request_id))
        if task is None or task.done():
            return False
        self.cancelled.add(task)
        task.cancel()
        return True

    def count(self, reason: str, run_id: str, tenant: str) -> None:
        self.dropped[reason] += 1
        record_generate_dropped(reason, run_id=run_id, tenant=tenant)

    def admit(
        self, req: GenerateRequest, tenant: str, bound: HttpBound
    ) -> tuple[GenerateResponse | None, int]:
        """The refusal of a request past its deadline or past ``bound`` (else None), and the
        tokens it counts against ``bound`` (to give back when it ends)."""
        if past_deadline(req):
            self.count("deadline", req.run_id, tenant)
            why = "its deadline passed before it arrived"
            return failure(req.request_id, req.run_id, why, "deadline_exceeded"), 0
        try:
            return None, bound.take(req)
        except Overloaded as exc:
            self.count("overloaded", req.run_id, tenant)
            refusal = failure(req.request_id, req.run_id, str(exc), "overloaded", exc.retry_after_s)
            return refusal, 0

    async def run(
        self,
        req: GenerateRequest,
        tenant: str,
        bound: HttpBound,
        generate: Callable[[], Awaitable[T]],
    ) -> T | GenerateResponse:
        """``generate()`` for ``req``, held here while it runs (so a GenerateCancel finds it);
        the answer instead when it is refused at arrival, cancelled or past its deadline."""
        refused, tokens = self.admit(req, tenant, bound)
        if refused is not None:
            return refused
        work = asyncio.ensure_future(generate())
        self.add(tenant, req.request_id, work)
        try:
            return await work
        except asyncio.CancelledError:
            if work not in self.cancelled:
                raise  # the replica is stopping
            self.count("cancelled", req.run_id, tenant)
            return failure(req.request_id, req.run_id, "cancelled by its requester", "cancelled")
        except DeadlineExceeded as exc:
            self.count("deadline", req.run_id, tenant)
            return failure(req.request_id, req.run_id, str(exc), "deadline_exceeded")
        finally:
            self.discard(tenant, req.request_id, work)
            bound.give_back(req, tokens)

    async def on_cancel(self, msg: Msg) -> None:
        """A GenerateCancel: stop the request it names, if the subject's tenant sent it here."""
        try:
            tenant = sj.tenant_of_subject(msg.subject)
            cancel: GenerateCancel = decode(
                msg.data, GenerateCancel, (msg.headers or {}).get("Content-Type")
            )
        except (ValueError, DecodeError) as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            return
        if self.cancel(tenant, cancel.request_id):
            log.debug("cancelled %s: %s", cancel.request_id, cancel.reason or "no reason given")
