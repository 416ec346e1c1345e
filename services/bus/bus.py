"""A service's connection to NATS: typed publish, request/reply and error reports.

``Bus.connect`` reconnects forever once connected (a restarted server is picked up again). Its
first connection is retried with backoff for as long as the caller allows (``wait``: a
service waits ``PLEXRL_CONNECT_WAIT_S``, a client command not at all), then fails with a clear
:class:`BusUnavailable`; a server that refuses the credentials, or whose TLS certificate cannot
be verified, is that error at once.

Credentials and TLS come from the process settings: ``PLEXRL_NATS_CREDS`` (an nkey seed file
of ``plexrl tenants add``, or a ``.creds`` file), ``PLEXRL_TLS_CA`` / ``PLEXRL_TLS_CERT`` /
``PLEXRL_TLS_KEY``; a client acting for a tenant (``PLEXRL_TENANT``) uses that tenant's inbox
prefix, the only reply subjects its credentials may subscribe to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import ConnectionClosedError, NoServersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext, api
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from schemas.codec import Format, content_type, decode, encode
from schemas.events import InvalidMessage, ServiceError
from schemas.subjects import errors_subject
from schemas.tenant import DEFAULT_TENANT, inbox_prefix
from services.bus import tracing
from services.bus.errors import BusUnavailable, PayloadTooLarge
from services.bus.limits import STREAM_SETTINGS, durable_write, full_as_error, stream_of
from services.bus.outage import any_reachable, outage_hint
from services.bus.provision import provision
from services.bus.reconnect import Reconnects
from services.bus.retry import Servers, with_backoff
from services.bus.security import credentials, tls_context
from services.config import ProcessSettings, process_settings
from services.telemetry.metrics import record_invalid

log = logging.getLogger(__name__)
T = TypeVar("T")

LEADING_BYTES = 256


def connect_options(settings: ProcessSettings) -> dict[str, Any]:
    """The ``nats.connect`` arguments that say who this process is: credentials, TLS and the
    tenant's inbox prefix. :class:`BusUnavailable` for a file that cannot be used."""
    options: dict[str, Any] = {}
    if settings.nats_creds is not None:
        options |= credentials(Path(settings.nats_creds))
    tls = tls_context(settings)
    if tls is not None:
        options["tls"] = tls
    if settings.tenant != DEFAULT_TENANT:
        options["inbox_prefix"] = inbox_prefix(settings.tenant)
    return options


def _refusal(exc: BaseException) -> str | None:
    """Why the server refused this client for good (credentials, TLS), or None for errors worth
    retrying (a server of the cluster still starting)."""
    text = str(exc)
    if "authorization violation" in text.lower():
        return "the server refused the credentials (authorization violation)"
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({exc.__class__.__name__}: {exc})"
    return None


def _advice_for(reason: str, settings: ProcessSettings) -> str:
    if "credentials" in reason:
        creds = settings.nats_creds
        if creds is None:
            return f"{reason}: it requires credentials; set PLEXRL_NATS_CREDS to a seed file"
        return (
            f"{reason} in {creds}: is its public key in the server's config (regenerate it "
            "with `plexrl nats-config` and reload the server)?"
        )
    if "certificate required" in reason.lower() and settings.tls_cert is None:
        return (
            f"{reason}: the server asks for a client certificate; set PLEXRL_TLS_CERT and "
            "PLEXRL_TLS_KEY"
        )
    if settings.tls_ca is None:
        return (
            f"{reason}: set PLEXRL_TLS_CA to the CA certificate that signed the server's "
            "certificate"
        )
    return f"{reason}; PLEXRL_TLS_CA is {settings.tls_ca}"


_BY_REFERENCE = (
    "send big data by reference (the object store, a file) or split it, or raise the "
    "server's max_payload (nats-server setting, at most 64 MiB)"
)
_SHRINK = {
    "RolloutBatch": (
        "lower the run's batch_size, group_size or sampling.max_tokens (a step travels as one "
        "message), or raise the server's max_payload (nats-server setting, at most 64 MiB; "
        "`plexrl up` uses 8 MiB); big data otherwise travels by reference"
    ),
}
"""What to do about an event over the server's max_payload, by event type."""

FIRST_RETRY_DELAY, MAX_RETRY_DELAY = 0.25, 5.0
"""seconds between tries of a first connection: 0.25, doubling up to 5"""

ADVICE = (
    "Start one with `plexrl up` (embedded) or `nats-server -js`, or point --nats-url / "
    "PLEXRL_NATS_URL at a running server."
)


class _Unreachable(BusUnavailable):
    """No server answered (yet): worth another try while the caller is willing to wait."""


async def _open(
    servers: list[str],
    url: str,
    service: str,
    settings: ProcessSettings,
    options: dict[str, Any],
    connect_timeout: float,
) -> tuple[NATS, list[Bus]]:
    """One try at a first connection: the client and the list its disconnect callback reads
    (the caller puts the Bus there). :class:`_Unreachable` when nothing answers,
    :class:`BusUnavailable` when the server refuses this client for good."""
    # nats-py retries a failed first connect forever when reconnects are unlimited, so probe
    # first: no server listening is an immediate, clear error instead of a hang.
    if not await any_reachable(servers, connect_timeout):
        raise _Unreachable(
            f"cannot reach NATS at {url}: nothing accepts connections there. {ADVICE}"
        )

    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def _on_error(exc: Exception) -> None:
        reason = _refusal(exc)
        if reason and not refused.done():
            refused.set_result(reason)  # read only while the first connect is under way
        if "permissions violation" in str(exc).lower():
            log.warning("%s: NATS refused an operation: %s", service, exc)
        elif reason:
            log.warning("%s: NATS connection refused: %s", service, reason)
        else:
            log.debug("%s: NATS connection error: %s", service, exc)

    closing: list[Bus] = []  # filled by the caller; a deliberate close is not worth a warning

    async def _on_disconnect() -> None:
        if not (closing and closing[0]._closing):
            log.warning("%s: disconnected from NATS, reconnecting", service)

    async def _on_reconnect() -> None:
        log.info("%s: reconnected to NATS", service)
        if closing:
            closing[0].reconnects.reconnected()

    nc = NATS()
    behaviour: dict[str, Any] = {
        "name": f"plexrl-{service}",
        "connect_timeout": connect_timeout,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": 0.25,
        "error_cb": _on_error,
        "disconnected_cb": _on_disconnect,
        "reconnected_cb": _on_reconnect,
    }
    connecting = asyncio.ensure_future(nc.connect(servers, **behaviour, **options))
    waiting: set[asyncio.Future[Any]] = {connecting, refused}
    done, _ = await asyncio.wait(
        waiting, timeout=connect_timeout * 3, return_when=asyncio.FIRST_COMPLETED
    )
    if connecting not in done:
        connecting.cancel()
        await asyncio.gather(connecting, return_exceptions=True)
        await nc.close()
        reason = refused.result() if refused.done() else None
        if reason is not None:
            raise BusUnavailable(f"NATS at {url}: {_advice_for(reason, settings)}")
        raise _Unreachable(
            f"cannot reach NATS at {url} (no answer within {connect_timeout * 3:g}s). {ADVICE}"
        )
    try:
        connecting.result()
    except (NoServersError, OSError) as exc:
        with contextlib.suppress(Exception):
            await nc.close()
        raise _Unreachable(
            f"cannot reach NATS at {url} ({exc.__class__.__name__}: {exc}). {ADVICE}"
        ) from None
    if "tls" in options and not nc._server_info.get("tls_required"):
        await nc.close()
        raise BusUnavailable(
            f"NATS at {url} does not speak TLS, but PLEXRL_TLS_* is set: refusing to send "
            "credentials and data in the clear"
        )
    return nc, closing


async def flushed(nc: NATS, timeout: int = 10) -> None:
    """Return once the server has processed everything ``nc`` sent before the call (a SUB just
    made: then a request from any connection finds the responder).

    nats-py's ``flush()`` writes its PING straight to the socket, ahead of commands still in
    the client's buffer, so its PONG does not prove the server has them: 8 of 2,000 requests
    from another connection right after ``subscribe(); flush()`` found no responder here. The
    first flush's round trip lets the buffer go out; the second PING follows it.
    """
    await nc.flush(timeout)
    await nc.flush(timeout)


class Bus:
    """One NATS connection, its JetStream context, and the name of the service using it."""

    def __init__(
        self,
        nc: NATS,
        service: str,
        fmt: Format = "json",
        *,
        servers: list[str] | None = None,
        outage_wait: float = 0.0,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.service = service
        self.fmt: Format = fmt
        self.servers = list(servers or [])
        """the servers this client was given (a cluster's several)"""
        self.outage_wait = outage_wait
        """seconds a JetStream operation waits while JetStream is unavailable (a cluster without
        its quorum) past its quick retries: a service waits as long as it lasts (``math.inf``),
        a client command not at all (see :meth:`until_available`)"""
        self.stopping: asyncio.Event | None = None
        """set when the service is asked to stop: an operation waiting for JetStream (no quorum)
        or for room in a full store then gives up with ``StoppedWaiting`` instead of waiting on"""
        self.invalid_count = 0
        self.reconnects = Reconnects(nc)  # what was in flight goes again after each
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
        wait: float = 0.0,
        outage_wait: float = 0.0,
        settings: ProcessSettings | None = None,
    ) -> Bus:
        """Connect to ``url`` (comma-separated for a cluster) and provision streams and buckets.

        Who connects (credentials, TLS, tenant) comes from ``settings``, by default the process
        settings; a process acting for several tenants (the gateway) passes each one's.

        While no server answers, retry for up to ``wait`` seconds (0: fail at once), waiting
        0.25 s, then twice as long each time up to 5 s, and logging each wait. A server that
        refuses the credentials or the TLS handshake is never retried. ``outage_wait`` is how
        long its JetStream operations wait while JetStream is unavailable once connected
        (:attr:`outage_wait`).
        """
        servers = [u.strip() for u in url.split(",") if u.strip()]
        settings = settings or process_settings()
        options = connect_options(settings)
        deadline = time.monotonic() + wait
        delay, attempt = FIRST_RETRY_DELAY, 1
        while True:
            try:
                nc, closing = await _open(servers, url, service, settings, options, connect_timeout)
                break
            except _Unreachable as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BusUnavailable(str(exc)) from None
                pause = min(delay, left)
                log.warning(
                    "%s: waiting for NATS at %s (attempt %d, next in %.2gs, giving up in %.0fs)",
                    service,
                    url,
                    attempt,
                    pause,
                    left,
                )
                await asyncio.sleep(pause)
                delay, attempt = min(delay * 2, MAX_RETRY_DELAY), attempt + 1
        if attempt > 1:
            log.info("%s: connected to NATS at %s after %d attempts", service, url, attempt)
        bus = cls(nc, service, fmt, servers=servers, outage_wait=outage_wait)
        closing.append(bus)
        # a tenant's credentials may not create or inspect streams: the services provision them
        if provision_streams and settings.tenant == DEFAULT_TENANT:
            try:
                await provision(bus.js, replicas=settings.stream_replicas, settings=settings)
            except BaseException:
                await bus.close()  # a limit the server cannot reserve, say: no half-open client
                raise
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

    # --- while JetStream is unavailable ----------------------------------------------------

    async def outage_hint(self) -> Servers:
        """What this client sees of its servers while JetStream does not answer, for the log."""
        return await outage_hint(self.servers)

    async def until_available(
        self,
        operation: Callable[[], Awaitable[T]],
        what: str,
        *,
        outage_wait: float | None = None,
    ) -> T:
        """``await operation()`` (a JetStream call that is safe to repeat: a read, an ack, a
        consumer lookup), tried again every 0.1 s, doubling up to 2 s, while it fails because
        JetStream is unavailable (:func:`~services.bus.retry.unavailable`: no quorum, no
        responders, a timeout), for up to ``outage_wait`` seconds (default
        :attr:`outage_wait`). A wait of more than a moment is logged once as a warning naming
        ``what``, and so is the resumption; every other error is raised at once."""
        return await with_backoff(
            operation,
            attempts=1,
            first_delay=0.1,
            max_delay=2.0,
            retry_on=(),
            give_up=lambda: self.nc.is_closed,
            outage_wait=self.outage_wait if outage_wait is None else outage_wait,
            what=f"{self.service}: {what}",
            hint=self.outage_hint,
            stop=self.stopping,
            lost=self.reconnects.lost,
        )

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
                f"{type(event).__name__} for {subject} is {len(data)} bytes encoded as {fmt}, "
                f"over the server's max_payload of {limit} bytes, so it was not sent: "
                f"{_SHRINK.get(type(event).__name__, _BY_REFERENCE)}"
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
        full_wait: float = math.inf,
        outage_wait: float | None = None,
    ) -> api.PubAck:
        """Publish ``event`` to a JetStream subject and wait for the stream's acknowledgement.

        ``msg_id`` becomes ``Nats-Msg-Id``, so a retried publish is stored once. Transient
        failures (no responders while the server restarts, timeouts) are retried with backoff.
        An event over the server's ``max_payload`` is :class:`PayloadTooLarge` before anything
        is sent. While the stream (or the server's store) is full the publish waits, up to
        ``full_wait`` seconds, then raises :class:`~services.bus.errors.StorageFull`, which
        says which stream and what to do (see :func:`~services.bus.limits.durable_write`).
        While JetStream is unavailable (a cluster without its quorum) it keeps trying past
        ``attempts`` for up to ``outage_wait`` seconds (default :attr:`outage_wait`), saying so
        once in the log.
        """
        fmt = fmt or self.fmt
        with self._tracer.start_as_current_span(
            f"publish {subject}",
            kind=SpanKind.PRODUCER,
            attributes={"messaging.destination": subject},
        ):
            data = self._encode(subject, event, fmt)
            headers = self._headers(msg_id, fmt)
            what = f"{self.service}: publishing {type(event).__name__} to {subject}"

            def retrying(exc: BaseException, attempt: int, _: float) -> None:
                log.debug("publish to %s failed (%s), retry %d", subject, exc, attempt)

            async def once() -> api.PubAck:
                stream = stream_of(subject)
                with full_as_error(
                    where=f"stream {stream}" if stream else f"the stream of {subject}",
                    setting=STREAM_SETTINGS.get(stream or "", ""),
                    what=f"{type(event).__name__} to {subject}",
                ):
                    return await self.js.publish(subject, data, timeout=timeout, headers=headers)

            return await durable_write(
                once,
                what=what,
                attempts=attempts,
                first_delay=0.05,
                max_delay=1.0,
                give_up=lambda: self.nc.is_closed,
                on_retry=retrying,
                full_wait=full_wait,
                outage_wait=self.outage_wait if outage_wait is None else outage_wait,
                hint=self.outage_hint,
                stop=self.stopping,
                lost=self.reconnects.lost,
            )

    async def request(
        self,
        subject: str,
        event: msgspec.Struct,
        response_type: type[T],
        *,
        timeout: float,
        fmt: Format | None = None,
    ) -> T:
        """Core NATS request/reply with a typed response (raises nats TimeoutError on timeout),
        sent again on each reconnect until answered (:func:`services.bus.reconnect.request`)."""
        fmt = fmt or self.fmt
        with self._tracer.start_as_current_span(f"request {subject}", kind=SpanKind.CLIENT):
            data, headers = self._encode(subject, event, fmt), self._headers(None, fmt)
            what = f"{self.service}: {type(event).__name__}"
            msg = await self.reconnects.request(subject, data, timeout, headers, what)
            return decode(msg.data, response_type, (msg.headers or {}).get("Content-Type"))

    # --- error reports --------------------------------------------------------------------

    async def report(self, event: InvalidMessage | ServiceError) -> None:
        """Publish an error report on ``plexrl.errors.<service>``; never raises."""
        try:
            await self.publish(
                errors_subject(self.service),
                event,
                attempts=3,
                timeout=2.0,
                full_wait=0,
                outage_wait=0,
            )
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
