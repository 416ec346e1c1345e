"""Tinker's futures: a request is answered at once with a request id, its work runs on, and the
client fetches the outcome with ``retrieve_future``.

A future's id is derived from what the client sent (the model and the request's ``seq_id``), so
a client that resends a request after a lost answer gets the same future, and the training
command it carries keeps the same ``request_id``: the trainer applies it once. Work of one model
runs in the order its requests arrived (the SDK sends a model's requests one at a time, in
``seq_id`` order), work of different models at the same time, which is what lets the trainer
put several runs' ``forward_backward`` calls into shared micro-batches.

Futures live in this process only, for ``ttl_s`` after they finish; a restarted gateway knows
none of the old ones (the client resends, see above).
"""

from __future__ import annotations

import asyncio
import logging
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
    finished_at: float | None = None
    waiters: int = field(default=0)


class Futures:
    """The futures of this gateway (see the module docstring)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}
        self._tails: dict[str, asyncio.Task[Outcome]] = {}

    def start(
        self, request_id: str, work: Callable[[], Awaitable[Outcome]], order: str | None = None
    ) -> str:
        """Run ``work`` as future ``request_id`` (once: a known id is left as it is), after the
        earlier work of the same ``order`` key."""
        self._expire()
        if request_id in self._entries:
            return request_id
        before = self._tails.get(order) if order else None
        task = asyncio.create_task(self._run(before, work), name=f"future {request_id}")
        entry = _Entry(task)
        self._entries[request_id] = entry
        task.add_done_callback(lambda _: setattr(entry, "finished_at", time.monotonic()))
        if order:
            self._tails[order] = task
            task.add_done_callback(lambda t: self._forget_tail(order, t))
        return request_id

    def _forget_tail(self, order: str, task: asyncio.Task[Outcome]) -> None:
        if self._tails.get(order) is task:
            del self._tails[order]

    @staticmethod
    async def _run(
        before: asyncio.Task[Outcome] | None, work: Callable[[], Awaitable[Outcome]]
    ) -> Outcome:
        if before is not None:
            await asyncio.wait({before})
        try:
            return await work()
        except GatewayError as exc:
            category: Category = "user" if 400 <= exc.status < 500 else "server"
            return Outcome(error=exc.message, category=category)
        except Exception as exc:
            log.exception("gateway: a future's work failed")
            return Outcome(error=f"{type(exc).__name__}: {exc}", category="server")

    def known(self, request_id: str) -> bool:
        return request_id in self._entries

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The outcome of ``request_id`` once it is done, or None if it is still running after
        ``timeout`` seconds. ``KeyError`` for an id this gateway does not know."""
        entry = self._entries[request_id]
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
            del self._entries[rid]

    async def close(self) -> None:
        """Cancel the work still running (at shutdown)."""
        running = [e.task for e in self._entries.values() if not e.task.done()]
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
