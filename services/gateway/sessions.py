"""Tinker sessions: what a ``ServiceClient`` holds, and how long.

A session is created by ``create_session`` and belongs to the tenant whose key created it; its
id is random. The training runs its training clients create are recorded in it, and in each
run's config as the label ``tinker.session``, so a restarted gateway finds them again (the
first request of a tenant adopts its runs' sessions, each as if it had just been heard from).
A session ends:

- when the client finishes it (``sessions/{id}/finish``: ``ServiceClient.close()`` and the end
  of a ``with ServiceClient() as s:`` block);
- when nothing was heard of it (no request naming it, no heartbeat: the SDK beats every 10 s)
  for ``session_ttl_s``: its client is gone.

Either way the runs it created are evicted, which gives their slots back; their checkpoints
stay (listed, loadable, downloadable) until the run is deleted. A finished session answers its
heartbeats with 410, which stops the SDK's heartbeat loop. Base-model sampling needs no run,
so a sampling client holds nothing.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SESSION_LABEL = "tinker.session"
"""the run config label that names the Tinker session that created the run"""

FORGET_AFTER_S = 3600.0
"""how long a finished session is remembered (its heartbeats get 410, not a new session)"""

Evict = Callable[[str, list[str], str], Awaitable[None]]
"""``evict(tenant, run_ids, reason)``"""


@dataclass
class Session:
    """One Tinker session of one tenant."""

    session_id: str
    tenant: str
    created_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    user_metadata: dict[str, str] = field(default_factory=dict)
    display_name: str = ""
    runs: set[str] = field(default_factory=set)
    samplers: list[str] = field(default_factory=list)
    finished: str | None = None
    """why it ended (``success``, ``errored``, ``interrupted``, ``expired``); None while open"""
    finished_at: float = 0.0


class Sessions:
    """The sessions this gateway knows, per tenant (see the module docstring)."""

    def __init__(self, ttl_s: float, evict: Evict) -> None:
        self.ttl_s = ttl_s
        self.evict = evict
        self._sessions: dict[tuple[str, str], Session] = {}
        self._adopted: set[str] = set()

    def create(self, tenant: str, user_metadata: dict[str, str], display_name: str = "") -> Session:
        session = Session(
            f"session-{secrets.token_hex(16)}",
            tenant,
            user_metadata=dict(user_metadata),
            display_name=display_name,
        )
        self._sessions[(tenant, session.session_id)] = session
        return session

    def get(self, tenant: str, session_id: str) -> Session | None:
        """``tenant``'s session (another tenant's is as unknown as one never made)."""
        return self._sessions.get((tenant, session_id))

    def of(self, tenant: str) -> list[Session]:
        return [s for (t, _), s in self._sessions.items() if t == tenant]

    def touch(self, tenant: str, session_id: str) -> Session:
        """``tenant``'s session, heard from now; one the gateway does not know (created before
        it restarted) is taken on as it is heard of."""
        session = self._sessions.get((tenant, session_id))
        if session is None:
            session = self._sessions[(tenant, session_id)] = Session(session_id, tenant)
        session.last_seen = time.monotonic()
        return session

    def add_run(self, tenant: str, session_id: str, run_id: str) -> None:
        if session_id:
            self.touch(tenant, session_id).runs.add(run_id)

    def adopt(self, tenant: str, runs: dict[str, str]) -> None:
        """Once per tenant: record the runs (run id -> session id, from their labels) of the
        sessions this gateway did not see created."""
        if tenant in self._adopted:
            return
        self._adopted.add(tenant)
        for run_id, session_id in runs.items():
            known = self._sessions.get((tenant, session_id))
            if known is None or known.finished is None:
                self.add_run(tenant, session_id, run_id)

    def adopted(self, tenant: str) -> bool:
        return tenant in self._adopted

    async def finish(self, tenant: str, session_id: str, reason: str) -> list[str]:
        """End the session and evict its runs; the runs evicted (none when it had ended)."""
        session = self.touch(tenant, session_id)
        if session.finished is not None:
            return []
        session.finished, session.finished_at = reason, time.monotonic()
        runs = sorted(session.runs)
        if runs:
            why = f"Tinker session {session_id} finished ({reason})"
            await self.evict(tenant, runs, why)
        log.info(
            "gateway: session %s of %s finished (%s): %d runs",
            session_id,
            tenant,
            reason,
            len(runs),
        )
        return runs

    async def expire(self) -> None:
        """Finish every open session silent for longer than ``ttl_s``."""
        now = time.monotonic()
        for key, session in list(self._sessions.items()):
            if session.finished is not None and now - session.finished_at > FORGET_AFTER_S:
                del self._sessions[key]  # its 410s have long stopped its heartbeats
            elif session.finished is None and now - session.last_seen > self.ttl_s:
                try:
                    await self.finish(session.tenant, session.session_id, "expired")
                except Exception as exc:  # one tenant's failure must not stop the others'
                    session.finished = None
                    log.warning("gateway: could not finish %s: %s", session.session_id, exc)

    async def run(self, stop: asyncio.Event, every_s: float) -> None:
        """Expire silent sessions every ``every_s`` seconds until ``stop`` is set."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                await self.expire()
