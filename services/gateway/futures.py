"""Tinker's futures: a request is answered at once with a request id, its work runs on, and the
client fetches the outcome with ``retrieve_future``.

A future belongs to the tenant whose key started it and is found by that tenant alone. Its id is
random (``<kind>-`` and 144 random bits), so nobody can guess another caller's; a request is
known by a key derived from what the client sent (the model and the request's ``seq_id``), so a
client that resends a request after a lost answer gets the same future, and the training command
it carries keeps the same ``request_id``: the trainer applies it once. Work of one model runs in
the order its requests arrived (the SDK sends a model's requests one at a time, in ``seq_id``
order), work of different models at the same time, which is what lets the trainer put several
runs' ``forward_backward`` calls into shared micro-batches. Each running future counts against
its tenant's ``max_concurrent_per_key``.

Futures live in this process only, for ``ttl_s`` after they finish; a restarted gateway knows
none of the old ones (the client resends, see above).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from services.gateway.backend import GatewayError

log = logging.getLogger(__name__)

Category = Literal["user", "server", "unknown"]


@dataclass
class Outcome:
    """What a finished future answers: a JSON body, protobuf bytes, or an error."""

    body: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: Category = "user"


@dataclass
class _Entry:
    task: asyncio.Task[Outcome]
    owner: str
    key: str
    finished_at: float | None = None
    waiters: int = field(default=0)


class Counter:
    """What a running future counts against: its owner's requests under way."""

    def begin(self, owner: str) -> None:
        """Count one more for ``owner``; raise (a GatewayError) when it may have no more."""

    def end(self, owner: str) -> None:
        """One fewer for ``owner``."""


class Futures:
    """The futures of this gateway (see the module docstring)."""

    def __init__(self, ttl_s: float, counter: Counter | None = None) -> None:
        self.ttl_s = ttl_s
        self.counter = counter or Counter()
        self._entries: dict[str, _Entry] = {}
        self._ids: dict[tuple[str, str], str] = {}
        self._tails: dict[tuple[str, str], asyncio.Task[Outcome]] = {}

    def start(
        self,
        owner: str,
        key: str,
        work: Callable[[], Awaitable[Outcome]],
        order: str | None = None,
        on_done: Callable[[], None] | None = None,
    ) -> str:
        """Run ``work`` as the future of ``owner``'s request ``key``, after the earlier work of
        the same ``order`` key of the same owner; its id. A key already known is not run again:
        its future's id is returned. ``on_done()`` is called once the future is done (at once
        for a key already known), whether ``work`` ran or not."""
        self._expire()
        known = self._ids.get((owner, key))
        if known is not None:
            if on_done is not None:
                on_done()
            return known
        self.counter.begin(owner)
        future_id = f"{key.partition(':')[0] or 'future'}-{secrets.token_urlsafe(18)}"
        tail = (owner, order) if order else None
        before = self._tails.get(tail) if tail else None
        task = asyncio.create_task(self._run(before, work), name=f"future {future_id}")
        entry = _Entry(task, owner, key)
        self._entries[future_id] = entry
        self._ids[(owner, key)] = future_id

        def done(_: asyncio.Task[Outcome]) -> None:
            entry.finished_at = time.monotonic()
            self.counter.end(owner)
            if on_done is not None:
                on_done()

        task.add_done_callback(done)
        if tail:
            self._tails[tail] = task
            task.add_done_callback(lambda t: self._forget_tail(tail, t))
        return future_id

    def _forget_tail(self, tail: tuple[str, str], task: asyncio.Task[Outcome]) -> None:
        if self._tails.get(tail) is task:
            del self._tails[tail]

    @staticmethod
    async def _run(
        before: asyncio.Task[Outcome] | None, work: Callable[[], Awaitable[Outcome]]
    ) -> Outcome:
        try:
            if before is not None:
                await asyncio.wait({before})
            return await work()
        except asyncio.CancelledError:  # cancel(): the client no longer wants it
            return Outcome(error="cancelled by the client (cancel_future)", category="user")
        except GatewayError as exc:
            category: Category = "user" if 400 <= exc.status < 500 else "server"
            return Outcome(error=exc.message, category=category)
        except Exception as exc:
            log.exception("gateway: a future's work failed")
            return Outcome(error=f"{type(exc).__name__}: {exc}", category="server")

    def cancel(self, owner: str, future_id: str) -> bool:
        """Cancel ``owner``'s future ``future_id`` if it is still running; whether it is one of
        ``owner``'s (another owner's future is as unknown as one never made)."""
        entry = self._entries.get(future_id)
        if entry is None or entry.owner != owner:
            return False
        if not entry.task.done():
            entry.task.cancel()
        return True

    def known(self, owner: str, future_id: str) -> bool:
        entry = self._entries.get(future_id)
        return entry is not None and entry.owner == owner

    async def wait(self, owner: str, future_id: str, timeout: float) -> Outcome | None:
        """The outcome of ``owner``'s future ``future_id`` once it is done, or None if it is
        still running after ``timeout`` seconds. ``KeyError`` for an id this gateway does not
        know for ``owner`` (another owner's future is as unknown as one never made)."""
        entry = self._entries.get(future_id)
        if entry is None or entry.owner != owner:
            raise KeyError(future_id)
        if not entry.task.done():
            await asyncio.wait({entry.task}, timeout=timeout)
        return entry.task.result() if entry.task.done() else None

    def _expire(self) -> None:
        now = time.monotonic()
        old = [
            rid
            for rid, e in self._entries.items()
            if e.finished_at is not None and now - e.finished_at > self.ttl_s
        ]
        for rid in old:
            entry = self._entries.pop(rid)
            self._ids.pop((entry.owner, entry.key), None)

    async def close(self) -> None:
        """Cancel the work still running (at shutdown; it ends as if its client cancelled it)."""
        running = [e.task for e in self._entries.values() if not e.task.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
