"""A service's connection to NATS: typed publish, request/reply and error reports.

``Bus.connect`` reconnects forever once connected (a restarted server is picked up again) and
fails fast, with a clear :class:`BusUnavailable`, when no server answers at start-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, TypeVar
from urllib.parse import urlparse

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext, api
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from schemas.codec import Format, content_type, decode, encode
from schemas.events import InvalidMessage, ServiceError
from schemas.subjects import errors_subject
from services.bus import tracing
from services.bus.errors import BusUnavailable, PayloadTooLarge
from services.bus.provision import provision
from services.config import process_settings
from services.telemetry.metrics import record_invalid

log = logging.getLogger(__name__)
T = TypeVar("T")

LEADING_BYTES = 256


async def _any_reachable(servers: list[str], timeout: float) -> bool:
    for server in servers:
        parsed = urlparse(server if "://" in server else f"nats://{server}")
        host, port = parsed.hostname or "127.0.0.1", parsed.port or 4222
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except (OSError, TimeoutError):
            continue
        writer.close()
        return True
    return False


class Bus:
    """One NATS connection, its JetStream context, and the name of the service using it."""

    def __init__(self, nc: NATS, service: str, fmt: Format = "json") -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.service = service
        self.fmt: Format = fmt
        self.invalid_count = 0
        self._closing = False
        self._tracer = tracing.tracer(f"plexrl.{service}")

    @classmethod
    async def connect(
        cls,
        url: str,
        service: str,
        *,
        connect_timeout: float = 5.0,
        provision_streams: bool = True,
        fmt: Format = "json",
    ) -> Bus:
        """Connect to ``url`` (comma-separated for a cluster) and provision streams and buckets."""
        servers = [u.strip() for u in url.split(",") if u.strip()]
        advice = (
            "Start one with `plexrl up` (embedded) or `nats-server -js`, or point --nats-url / "
            "PLEXRL_NATS_URL at a running server."
        )
        # nats-py retries a failed first connect forever when reconnects are unlimited, so probe
        # first: no server listening is an immediate, clear error instead of a hang.
        if not await _any_reachable(servers, connect_timeout):
            raise BusUnavailable(
                f"cannot reach NATS at {url}: nothing accepts connections there. {advice}"
            )

        async def _on_error(exc: Exception) -> None:
            log.debug("%s: NATS connection error: %s", service, exc)

        closing: list[Bus] = []  # filled below; a deliberate close is not worth a warning

        async def _on_disconnect() -> None:
            if not (closing and closing[0]._closing):
                log.warning("%s: disconnected from NATS, reconnecting", service)

        async def _on_reconnect() -> None:
            log.info("%s: reconnected to NATS", service)

        try:
            connecting = nats.connect(
                servers,
                name=f"plexrl-{service}",
                connect_timeout=connect_timeout,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.25,
                error_cb=_on_error,
                disconnected_cb=_on_disconnect,
                reconnected_cb=_on_reconnect,
            )
            nc = await asyncio.wait_for(connecting, timeout=connect_timeout * 3)
        except (TimeoutError, NoServersError, OSError) as exc:
            raise BusUnavailable(
                f"cannot reach NATS at {url} ({exc.__class__.__name__}: {exc}). {advice}"
            ) from None
        bus = cls(nc, service, fmt)
        closing.append(bus)
        if provision_streams:
            await provision(bus.js, replicas=process_settings().stream_replicas)
        return bus

    async def close(self) -> None:
        """Flush and close. Callers unsubscribe their pull subscriptions first (drain would wait)."""
        if self.nc.is_closed:
            return
        self._closing = True
        try:
            await asyncio.wait_for(self.nc.flush(), timeout=2.0)
        except (TimeoutError, NatsTimeout, ConnectionClosedError):
            pass
        await self.nc.close()

    # --- publishing -----------------------------------------------------------------------

    def _headers(self, msg_id: str | None, fmt: Format) -> dict[str, str]:
        headers: dict[str, str] = {"Content-Type": content_type(fmt)}
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        return tracing.inject(headers)

    def _encode(self, subject: str, event: msgspec.Struct, fmt: Format) -> bytes:
        data = encode(event, fmt)
        limit = self.nc.max_payload or 0
        if limit and len(data) > limit:
            raise PayloadTooLarge(
                f"{type(event).__name__} for {subject} is {len(data)} bytes, over the server's "
                f"max_payload of {limit}: send big data by reference (object store) or split it"
            )
        return data

    async def publish(
        self,
        subject: str,
        event: msgspec.Struct,
        *,
        msg_id: str | None = None,
        fmt: Format | None = None,
        timeout: float = 5.0,
        attempts: int = 20,
    ) -> api.PubAck:
        """Publish ``event`` to a JetStream subject and wait for the stream's acknowledgement.

        ``msg_id`` becomes ``Nats-Msg-Id``, so a retried publish is stored once. Transient
        failures (no responders while the server restarts, timeouts) are retried with backoff.
        """
        fmt = fmt or self.fmt
        with self._tracer.start_as_current_span(
            f"publish {subject}",
            kind=SpanKind.PRODUCER,
            attributes={"messaging.destination": subject},
        ):
            data = self._encode(subject, event, fmt)
            headers = self._headers(msg_id, fmt)
            delay = 0.05
            for attempt in range(1, attempts + 1):
                try:
                    return await self.js.publish(subject, data, timeout=timeout, headers=headers)
                except (NoRespondersError, NatsTimeout, ConnectionClosedError) as exc:
                    if attempt == attempts or self.nc.is_closed:
                        raise
                    log.debug("publish to %s failed (%s), retry %d", subject, exc, attempt)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            raise AssertionError("unreachable")

    async def request(
        self,
        subject: str,
        event: msgspec.Struct,
        response_type: type[T],
        *,
        timeout: float,
        fmt: Format | None = None,
    ) -> T:
        """Core NATS request/reply with a typed response (raises nats TimeoutError on timeout)."""
        fmt = fmt or self.fmt
        with self._tracer.start_as_current_span(f"request {subject}", kind=SpanKind.CLIENT):
            data = self._encode(subject, event, fmt)
            msg = await self.nc.request(
                subject, data, timeout=timeout, headers=self._headers(None, fmt)
            )
            return decode(msg.data, response_type, (msg.headers or {}).get("Content-Type"))

    # --- error reports --------------------------------------------------------------------

    async def report(self, event: InvalidMessage | ServiceError) -> None:
        """Publish an error report on ``plexrl.errors.<service>``; never raises."""
        try:
            await self.publish(errors_subject(self.service), event, attempts=3, timeout=2.0)
        except Exception as exc:
            log.error("%s: could not report %s: %s", self.service, type(event).__name__, exc)

    async def report_invalid(self, subject: str, error: str, payload: bytes) -> None:
        """Count and report a message that failed to decode or validate."""
        self.invalid_count += 1
        record_invalid(self.service, subject)
        log.warning("%s: invalid message on %s: %s", self.service, subject, error)
        trace.get_current_span().set_attribute("plexrl.invalid", True)
        await self.report(
            InvalidMessage(
                service=self.service,
                subject=subject,
                error=error[:16000],
                leading_bytes=bytes(payload[:LEADING_BYTES]),
            )
        )

    async def report_error(self, error: str, run_id: str | None = None, **context: Any) -> None:
        await self.report(
            ServiceError(
                service=self.service,
                error=error[:16000],
                run_id=run_id,
                context={k: str(v) for k, v in context.items()} | {"at": f"{time.time():.3f}"},
            )
        )
