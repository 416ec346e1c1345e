"""Liveness of a request in flight: GenerateProgress to the requester's ``progress_subject``.

A requester that names a ``progress_subject`` hears from the replica holding its request at
once, on every change of state and every ``progress_every_s`` seconds until the reply is sent.
If the replica dies (SIGKILL, a lost host) the messages stop, and the requester can send the
request again at once instead of waiting out its own timeout.

Progress is a courtesy, never a condition of the request: a publish that fails (a closed
connection, a slow consumer) is logged at debug level and the request goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TypeVar

from nats.aio.client import Client as NATS

from schemas.codec import Format, content_type, encode
from schemas.events import GenerateProgress, GenerateRequest, ProgressState
from services.inference.requests import REPLICA_HEADER, request_format

log = logging.getLogger(__name__)


class ProgressBeacon:
    """Publishes GenerateProgress for one request while the ``async with`` block runs.

    ``state`` starts as given (``waiting_for_version``); assigning another sends a message at
    once.
    """

    def __init__(
        self,
        nc: NATS,
        req: GenerateRequest,
        replica: str,
        fmt: Format,
        state: ProgressState = "waiting_for_version",
    ) -> None:
        assert req.progress_subject is not None
        self.nc = nc
        self.subject = req.progress_subject
        self.every = req.progress_every_s
        self.request_id = req.request_id
        self.run_id = req.run_id
        self.replica = replica
        self.fmt = fmt
        self.sent = 0
        self._state: ProgressState = state
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> ProgressState:
        return self._state

    @state.setter
    def state(self, value: ProgressState) -> None:
        if value != self._state:
            self._state = value
            self._wake.set()

    async def __aenter__(self) -> ProgressBeacon:
        self._task = asyncio.create_task(self._beat(), name=f"progress {self.request_id}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _beat(self) -> None:
        headers = {"Content-Type": content_type(self.fmt), REPLICA_HEADER: self.replica}
        while True:
            self._wake.clear()
            event = GenerateProgress(
                request_id=self.request_id,
                run_id=self.run_id,
                replica=self.replica,
                state=self._state,
                seq=self.sent,
            )
            try:
                await self.nc.publish(self.subject, encode(event, self.fmt), headers=headers)
                self.sent += 1
            except Exception as exc:  # the request goes on without its progress
                log.debug("progress of %s to %s failed: %s", self.request_id, self.subject, exc)
            try:
                await asyncio.wait_for(self._wake.wait(), self.every)
            except TimeoutError:
                pass


T = TypeVar("T")


async def beaconed(
    nc: NATS,
    req: GenerateRequest,
    replica: str,
    headers: dict[str, str],
    generate: Callable[[GenerateRequest, str, ProgressBeacon | None], Awaitable[T]],
    tenant: str,
) -> T:
    """``generate(req, tenant, beacon)``, with a :class:`ProgressBeacon` speaking for it while
    it runs when the request names a progress subject (None when it does not)."""
    if req.progress_subject is None:
        return await generate(req, tenant, None)
    async with ProgressBeacon(nc, req, replica, request_format(headers)) as beacon:
        return await generate(req, tenant, beacon)
