"""JetStream publishes sent back to back, each with a future for its acknowledgement.

nats-py's ``publish_async`` does the same, but when the server answers with an error (a stream
or the whole store full, for instance) its future is never resolved: the error escapes into the
client's subscription task instead (nats-io/nats.py#985), and a caller waiting on the future
waits for its timeout, then knows only that it timed out. Here every answer settles its future:
a :class:`~nats.js.api.PubAck`, the server's :class:`~nats.js.errors.APIError`, or
:class:`~nats.errors.NoRespondersError` when no stream captures the subject.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from types import TracebackType

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api
from nats.js.errors import APIError

NO_RESPONDERS = "503"


def _api_error(error: dict[str, object]) -> APIError:
    """The exception nats-py would raise for a JetStream error answer (its factory raises)."""
    try:
        APIError.from_error(error)
    except APIError as exc:
        return exc
    raise AssertionError("APIError.from_error always raises")


class AckPipeline:
    """Publishes on one connection whose acknowledgements come back to one inbox.

    Use as ``async with AckPipeline(nc) as pipeline:``; :meth:`publish` sends at once and returns
    the acknowledgement's future, so messages go out in the order they are published. Leaving
    the block cancels the futures still pending.
    """

    def __init__(self, nc: NATS) -> None:
        self._nc = nc
        self._inbox = nc.new_inbox()
        self._tokens = itertools.count()
        self._pending: dict[str, asyncio.Future[api.PubAck]] = {}
        self._sub: Subscription | None = None

    async def __aenter__(self) -> AckPipeline:
        self._sub = await self._nc.subscribe(f"{self._inbox}.*", cb=self._answer)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._sub is not None and not self._nc.is_closed:
            try:
                await self._sub.unsubscribe()
            except nats.errors.Error:
                pass  # the connection went away: the subscription went with it

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[api.PubAck]:
        """Send ``data`` to ``subject``; the future settles with the stream's answer."""
        token = str(next(self._tokens))
        future: asyncio.Future[api.PubAck] = asyncio.get_running_loop().create_future()
        self._pending[token] = future
        await self._nc.publish(subject, data, reply=f"{self._inbox}.{token}", headers=headers)
        return future

    async def _answer(self, msg: Msg) -> None:
        future = self._pending.pop(msg.subject.rsplit(".", 1)[-1], None)
        if future is None or future.done():
            return
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            future.set_exception(nats.errors.NoRespondersError())
            return
        try:
            answer = json.loads(msg.data)
            if "error" in answer:
                future.set_exception(_api_error(answer["error"]))
            else:
                future.set_result(api.PubAck.from_response(answer))
        except (ValueError, TypeError, KeyError) as exc:
            future.set_exception(nats.errors.Error(f"unreadable acknowledgement: {exc}"))
