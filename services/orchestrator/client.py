"""The orchestrator's side of ``plexrl.inference.generate``: request/reply with retries.

A tenant's orchestrator asks on ``plexrl.inference.<tenant>.generate``, the only generate subject
its credentials allow.

Inference replicas come and go (a restart, a replica still loading its model, a queue group
that is momentarily empty), and a replica may not yet hold the policy version a request
demands. None of that should end a run, so :meth:`GenerateClient.generate` retries, with
exponential backoff capped at ``max_backoff``, whenever

- no replica answers in time (a NATS timeout),
- nobody listens on the subject (NATS "no responders"),
- the reply's ``error`` is one a replica sends for a transient condition (see
  :func:`is_retryable_error`: the version is not loaded yet, the run is not known yet...),
- the replica holding the request went silent: with ``progress_every_s > 0`` each attempt
  names a fresh inbox as the request's ``progress_subject`` (see :mod:`.liveness`); once a
  replica has sent progress there, ``3 * progress_every_s + 2`` seconds without any means it
  died with the request (a SIGKILL, a lost host), and the request is sent again at once, with
  no backoff, instead of after the attempt's ``timeout``. Once this client has heard progress
  from any replica, so does an attempt that hears none at all within that time (its replica
  died before it said a word). Until then a replica that sends no progress (one older than the
  field) is waited for exactly as before.

Any other error reply is final and raises :class:`GenerationError`. Each retry is logged with
the request id and the reason: at warning level once per reason every ``warn_every`` seconds
(a step's many requests usually fail for the same reason at the same time, and a long outage
should stay visible without flooding the log), at debug level otherwise. Setting the ``stop`` event ends the retries:
:class:`GenerationStopped` is raised instead of another attempt; a request already in flight is
awaited, so a step that was being generated can still be published.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from schemas.events import GenerateRequest, GenerateResponse
from schemas.subjects import generate_subject
from services.bus import Bus
from services.orchestrator.lifecycle import acting_tenant
from services.orchestrator.liveness import ReplicaSilent, ask_with_progress

log = logging.getLogger(__name__)

# Transient conditions as replicas word them. The inference service says "unknown run ..." while
# its run mirror has not applied the RunDiscovered yet, and "... asks for min_policy_version N;
# gave up after waiting ..." when the announced adapter is not loaded within the request's
# timeout_s; other engines say "not loaded yet", "busy" or "shutting down".
_RETRYABLE = re.compile(
    r"not (yet )?(loaded|available|known|ready)|(loaded|available|known|ready) yet|"
    r"asks for min_policy_version|unknown run|no adapter|not serving|busy|overloaded|"
    r"try again|shutting down|draining",
    re.IGNORECASE,
)


def is_retryable_error(error: str) -> bool:
    """Whether an error reply describes a condition that passes by itself.

    A version not loaded yet, a run the replica does not know yet, a busy or stopping replica
    pass; anything else (a malformed request, a prompt longer than the model's context, a run
    the replica cannot serve) fails the same way on every retry.
    """
    return _RETRYABLE.search(error) is not None


class GenerationError(RuntimeError):
    """Inference answered with an error that retrying will not fix."""


class GenerationStopped(Exception):
    """The stop event was set while a request waited for its next attempt."""


class GenerateClient:
    """Sends GenerateRequests on ``subject`` and retries transient failures.

    ``subject`` defaults to the generate subject of ``tenant`` (default: the tenant this process
    acts for): ``plexrl.inference.generate`` for the default tenant.

    ``timeout`` bounds one attempt: the time a replica may take to wait for the policy version
    and to generate. ``max_attempts`` of None retries until ``stop`` is set (or the caller
    cancels), which is what a long-lived run wants. ``progress_every_s`` is how often the
    replica holding a request should say so (0: never ask, and wait for each attempt's timeout).
    """

    def __init__(
        self,
        bus: Bus,
        *,
        timeout: float,
        stop: asyncio.Event | None = None,
        initial_backoff: float = 0.25,
        max_backoff: float = 5.0,
        max_attempts: int | None = None,
        subject: str | None = None,
        tenant: str | None = None,
        warn_every: float = 10.0,
        progress_every_s: float = 2.0,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if progress_every_s != 0 and not 0.1 <= progress_every_s <= 60:
            raise ValueError(
                f"progress_every_s must be 0 (off) or 0.1..60 seconds, got {progress_every_s}"
            )
        self.bus = bus
        self.timeout = timeout
        self.stop = stop or asyncio.Event()
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.max_attempts = max_attempts
        self.subject = subject or generate_subject(acting_tenant(tenant))
        self.warn_every = warn_every
        self._warned: dict[str, float] = {}
        self.progress_every_s = progress_every_s
        self.retries = 0
        """retries made by this client since it was created (for metrics and tests)"""
        self.progress_received = 0
        """GenerateProgress messages heard from replicas holding this client's requests"""
        self.silent_replicas = 0
        """attempts abandoned because the replica holding them went silent"""

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """The reply to ``request``; retries as the module docstring says."""
        delay = self.initial_backoff
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self._attempt(request)
            except NatsTimeout:
                reason = f"no reply within {self.timeout:g}s"
            except NoRespondersError:
                reason = f"no inference replica listens on {self.subject}"
            except ReplicaSilent as silent:
                self.silent_replicas += 1
                reason = str(silent)
                if self.max_attempts is not None and attempt >= self.max_attempts:
                    raise GenerationError(
                        f"{request.request_id}: giving up after {attempt} attempts; last: {reason}"
                    ) from None
                self._retry_now(request, silent)
                continue
            else:
                if not response.error:
                    return response
                if not is_retryable_error(response.error):
                    raise GenerationError(
                        f"inference refused {request.request_id}: {response.error}"
                    )
                reason = f"inference answered: {response.error}"
            if self.max_attempts is not None and attempt >= self.max_attempts:
                raise GenerationError(
                    f"{request.request_id}: giving up after {attempt} attempts; last: {reason}"
                )
            await self._back_off(request, attempt, reason, delay)
            delay = min(delay * 2, self.max_backoff)

    async def _attempt(self, request: GenerateRequest) -> GenerateResponse:
        """One request/reply, watched for progress when ``progress_every_s`` asks for it."""
        if not self.progress_every_s:
            return await self.bus.request(
                self.subject, request, GenerateResponse, timeout=self.timeout
            )
        return await ask_with_progress(
            self.bus,
            self.subject,
            request,
            timeout=self.timeout,
            every=self.progress_every_s,
            on_progress=self._count_progress,
            expect=self.progress_received > 0,
        )

    def _count_progress(self) -> None:
        self.progress_received += 1

    def _retry_now(self, request: GenerateRequest, silent: ReplicaSilent) -> None:
        """Retry at once: the request is not waiting for anything but a live replica."""
        if self.stop.is_set():
            raise GenerationStopped(request.request_id)
        self.retries += 1
        # One warning per silent replica (every warn_every): its many requests die together.
        log.log(
            self._level(f"replica {silent.replica} went silent"),
            "replica %s went silent for %.1fs while holding request %s; retrying",
            silent.replica,
            silent.silent_for,
            request.request_id,
        )

    def _level(self, reason: str) -> int:
        """WARNING the first time ``reason`` comes up in ``warn_every`` seconds, else DEBUG."""
        now = time.monotonic()
        if now - self._warned.get(reason, -math.inf) < self.warn_every:
            return logging.DEBUG
        if len(self._warned) > 256:  # reasons carry version numbers: keep the memo small
            self._warned.clear()
        self._warned[reason] = now
        return logging.WARNING

    async def _back_off(
        self, request: GenerateRequest, attempt: int, reason: str, delay: float
    ) -> None:
        if self.stop.is_set():
            raise GenerationStopped(request.request_id)
        self.retries += 1
        level = self._level(reason)
        log.log(
            level,
            "%s: %s; retrying in %.2fs (attempt %d)",
            request.request_id,
            reason,
            delay,
            attempt + 1,
        )
        try:
            await asyncio.wait_for(self.stop.wait(), delay)
        except TimeoutError:
            return
        raise GenerationStopped(request.request_id)
