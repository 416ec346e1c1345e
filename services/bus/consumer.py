"""A typed, durable JetStream pull consumer.

Each message is decoded into the expected event type inside a span whose parent is the
publisher's trace. Then, at this one boundary, the verdict:

- the payload does not decode or validate -> ``term`` (never redelivered) and an
  ``InvalidMessage`` on ``plexrl.errors.<service>``;
- the handler raises :class:`Reject` -> the same;
- the handler raises :class:`Retry` or any other exception -> ``nak`` with a delay;
- the handler returns -> ``ack`` (waiting for the server's confirmation).

A service owns its durable consumers: :meth:`Consumer.start` finds an existing one with another
config (another filter, a push delivery subject, other acknowledgement limits: what an operator
or a misbehaving client changed) and puts it back to the config the service needs, updating it
in place or, when the server cannot, making it anew; it logs and reports each such repair.

A consumer that counts what its user holds (:meth:`Consumer.recover_on_reconnect`: every delivery
handed out and not yet settled; an ack, nak or term counts as settled from the moment it is sent,
so a delivery still in its user's hands after its ack is not counted) gets back at once,
after a reconnect (or a fetch that failed: the consumer's leader died), the messages a lost
connection or a restarted server took with it: a message handed to it that never arrived, or one
whose acknowledgement the server confirmed and then lost when it was killed (it confirms an ack
before the consumer's state is on disk). The server would deliver them again only when their
``ack_wait`` runs out; instead the consumer is made anew from its ack floor (see
:meth:`Consumer.take_over`), and the deliveries it held before become stale: settling one is a
no-op, as its message comes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import APIError, NotFoundError
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from schemas.codec import DecodeError, decode
from services.bus import tracing
from services.bus.bus import Bus
from services.bus.errors import Reject, Retry
from services.telemetry.metrics import record_queue_depth

log = logging.getLogger(__name__)
T = TypeVar("T")

Handler = Callable[[T, "Delivery"], Awaitable[None]]


@dataclass
class Delivery:
    """One received message: where it came from and how to settle it."""

    msg: Msg
    subject: str
    headers: dict[str, str]
    stream_sequence: int
    num_delivered: int
    context: otel_context.Context = field(default_factory=otel_context.Context)
    bus: Bus | None = None
    """the connection it came on: an ack waits on it while JetStream is unavailable"""
    consumer: Consumer[Any] | None = None
    generation: int = 0
    """the consumer's generation it came from; once the consumer is made anew, its message
    comes again, and settling this delivery is a no-op"""

    @property
    def stale(self) -> bool:
        return self.consumer is not None and self.generation != self.consumer.generation

    def _settling(self) -> None:
        """An ack, nak or term of this message is on its way: its consumer stops counting it as
        held (a server that forgot the ack then shows one more held than the user has)."""
        if self.consumer is not None and not self.stale:
            self.consumer._settled(self.stream_sequence)

    async def ack(self) -> None:
        """Acknowledge, waiting for the server's confirmation; while JetStream is unavailable
        (the consumer has no leader: a cluster without its quorum) for as long as the bus's
        ``outage_wait`` allows. An ack repeated is harmless."""
        self._settling()
        if self.bus is None:
            if not self.stale:
                await self.msg.ack_sync()
            return

        async def ack() -> None:
            # checked on every try: a consumer made anew meanwhile never answers this one
            if not self.stale:
                await self.msg.ack_sync()

        what = f"acknowledging {self.subject} (stream sequence {self.stream_sequence})"
        await self.bus.until_available(ack, what)

    async def nak(self, delay: float | None = None) -> None:
        self._settling()
        if not self.stale:
            await self.msg.nak(delay=delay)

    async def term(self) -> None:
        self._settling()
        if not self.stale:
            await self.msg.term()

    async def in_progress(self) -> None:
        """Reset the ack timer while a long piece of work (a training step) holds the message."""
        if not self.stale:
            await self.msg.in_progress()


_OWNED = ("filter_subject", "ack_policy", "ack_wait", "max_deliver", "max_ack_pending")
"""The fields of a durable consumer its service insists on (besides being a pull consumer with
one filter)."""


def config_drift(current: api.ConsumerConfig, wanted: api.ConsumerConfig) -> list[str]:
    """How ``current`` differs from ``wanted`` in what a service insists on (empty: not at all)."""
    drift = [
        f"{f} {getattr(current, f)!r}, not {getattr(wanted, f)!r}"
        for f in _OWNED
        if _normal(f, getattr(current, f)) != _normal(f, getattr(wanted, f))
    ]
    if current.deliver_subject:
        drift.append(f"push delivery to {current.deliver_subject!r}")
    if current.filter_subjects:
        drift.append(f"filter_subjects {current.filter_subjects!r}")
    return drift


def _normal(field_name: str, value: Any) -> Any:
    if field_name == "max_deliver" and value is None:
        return -1
    if field_name == "ack_wait" and value is not None:
        return round(float(value), 3)
    return value


def _pending(msgs: list[Msg]) -> int:
    """Messages still waiting for this consumer after ``msgs`` (0 after an empty fetch)."""
    try:
        return msgs[-1].metadata.num_pending if msgs else 0
    except Exception:  # a non-JetStream message has no metadata
        return 0


def _delivery(msg: Msg, bus: Bus | None = None, consumer: Consumer[Any] | None = None) -> Delivery:
    headers = dict(msg.headers or {})
    seq, delivered = 0, 1
    try:
        md = msg.metadata
        seq = md.sequence.stream if md.sequence else 0
        delivered = md.num_delivered or 1
    except Exception:  # a non-JetStream message has no metadata
        pass
    generation = consumer.generation if consumer is not None else 0
    context = tracing.extract(headers)
    delivery = Delivery(
        msg, msg.subject, headers, seq, delivered, context, bus, consumer, generation
    )
    if consumer is not None:
        consumer._handed_out(delivery)
    return delivery


class Consumer(Generic[T]):
    """A durable pull consumer on ``stream`` filtered to ``filter_subject``, decoding ``event_type``."""

    def __init__(
        self,
        bus: Bus,
        *,
        stream: str,
        durable: str | None,
        filter_subject: str,
        event_type: Any,
        ack_wait: float = 60.0,
        max_deliver: int = -1,
        deliver_policy: api.DeliverPolicy = api.DeliverPolicy.ALL,
        batch: int = 32,
        fetch_timeout: float = 0.5,
        max_ack_pending: int = 1000,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.filter_subject = filter_subject
        self.event_type = event_type
        self.batch = batch
        self.fetch_timeout = fetch_timeout
        self.config = api.ConsumerConfig(
            durable_name=durable,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            deliver_policy=deliver_policy,
            filter_subject=filter_subject,
            max_ack_pending=max_ack_pending,
        )
        self._sub: JetStreamContext.PullSubscription | None = None
        self._tracer = tracing.tracer(f"plexrl.{bus.service}")
        self.generation = 0
        """how many times this consumer was made anew to get back what it lost"""
        self._held: set[int] | None = None
        """the stream sequences handed out in deliveries not yet settled; counted once
        :meth:`recover_on_reconnect` is on"""
        self._lost_check = False
        self._lock = asyncio.Lock()

    async def start(self) -> Consumer[T]:
        """Create the consumer or restore its config (see the module docstring), and subscribe;
        while JetStream is unavailable this waits as long as the bus's ``outage_wait`` allows."""
        if self._sub is None:
            await self.bus.until_available(
                self._own_config, f"checking consumer {self.durable} of {self.stream}"
            )
            self._sub = await self.bus.until_available(
                lambda: self.bus.js.pull_subscribe(
                    self.filter_subject,
                    durable=self.durable,
                    stream=self.stream,
                    config=self.config,
                ),
                f"creating consumer {self.durable or self.filter_subject} on {self.stream}",
            )
        return self

    async def _own_config(self) -> None:
        """Put an existing durable consumer back to :attr:`config` where it differs."""
        if self.durable is None:
            return
        try:
            info = await self.bus.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            return  # subscribing creates it
        drift = config_drift(info.config, self.config)
        if not drift:
            return
        what = f"consumer {self.durable} of stream {self.stream}"
        try:
            await self.bus.js.add_consumer(self.stream, config=self.config)
            how = "updated in place"
        except APIError as exc:  # a field the server does not change in place (push to pull)
            log.debug("%s: update refused (%s); making it anew", what, exc)
            await self.bus.js.delete_consumer(self.stream, self.durable)
            await self.bus.js.add_consumer(self.stream, config=self.config)
            how = "made anew"
        message = f"{what} had been changed ({'; '.join(drift)}); {how} with its own config"
        log.warning("%s: %s", self.bus.service, message)
        await self.bus.report_error(message, consumer=self.durable, stream=self.stream)

    async def take_over(self) -> int:
        """Make what a dead predecessor held deliverable now; how many messages it held.

        The messages a consumer delivered and never acked come back only when their
        ``ack_wait`` runs out, which for a trainer step is minutes. A process that knows it is
        the consumer's only user (the trainer's rank 0, on a restart) calls this before
        :meth:`start`: if the durable consumer has unacknowledged messages, it is made anew
        from the first one not yet acknowledged (the ack floor + 1), so they are delivered at
        once. Messages past the floor that were acked are delivered again too; the caller must
        recognise work it already did (the trainer's intake acks and skips committed steps).
        """
        if self.durable is None or self._sub is not None:
            return 0
        durable = self.durable
        try:
            info = await self.bus.until_available(
                lambda: self.bus.js.consumer_info(self.stream, durable),
                f"reading consumer {durable} of {self.stream}",
            )
        except NotFoundError:
            return 0
        held = int(info.num_ack_pending or 0)
        if held == 0:
            return 0
        start = await self._anew_from(info)
        log.info(
            "%s: took over consumer %s: %d unacknowledged messages from stream sequence %d on",
            self.bus.service,
            self.durable,
            held,
            start,
        )
        return held

    async def _anew_from(self, info: api.ConsumerInfo) -> int:
        """Make the durable consumer anew from its ack floor + 1 (that sequence)."""
        assert self.durable is not None
        start = int(info.ack_floor.stream_seq if info.ack_floor else 0) + 1
        with contextlib.suppress(NotFoundError):  # gone already: made below
            await self.bus.until_available(
                lambda: self.bus.js.delete_consumer(self.stream, self.durable or ""),
                f"replacing consumer {self.durable} of {self.stream}",
            )
        self.config = dataclasses.replace(
            self.config,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
        )
        if self._held is not None:
            self._held.clear()  # every one held comes again, in the next generation
        await self.start()
        return start

    def recover_on_reconnect(self) -> None:
        """After every reconnect, get back at once what the lost connection took (see the
        module docstring). From now on the consumer counts the deliveries it hands out until
        each is settled (acked, nacked or terminated); it must have no other user."""
        if self._held is None:
            self.bus.reconnects.on_reconnect(self._reconnected)
            self._held = set()

    def _handed_out(self, delivery: Delivery) -> None:
        if self._held is not None:
            self._held.add(delivery.stream_sequence)

    def _settled(self, stream_sequence: int) -> None:
        if self._held is not None:
            self._held.discard(stream_sequence)

    def holding(self) -> set[int]:
        """The stream sequences delivered and not yet settled (empty when not counting)."""
        return set(self._held or ())

    def _reconnected(self) -> None:
        self._lost_check = True

    async def _recover_lost(self) -> int:
        """Messages the server holds as delivered to this consumer and the caller does not:
        if any, make the consumer anew so that they come again now; how many."""
        if self.durable is None or self._held is None:
            return 0
        durable = self.durable
        info = await self.bus.until_available(
            lambda: self.bus.js.consumer_info(self.stream, durable),
            f"reading consumer {durable} of {self.stream}",
        )
        delivered = int(info.delivered.stream_seq if info.delivered else 0)
        # Held (delivered, unsettled) by the user; past what the server remembers delivering
        # the server delivers again by itself. A settled one is not counted even while its user
        # still has it (an ack confirmed and then lost with a killed server must show here).
        ours = {seq for seq in self._held if seq <= delivered}
        lost = int(info.num_ack_pending or 0) - len(ours)
        if lost <= 0:
            return 0
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.generation += 1
        start = await self._anew_from(info)
        log.warning(
            "%s: consumer %s: %d messages delivered before the reconnect never arrived or lost "
            "their acks with the server; delivered again from stream sequence %d on, now",
            self.bus.service,
            durable,
            lost,
            start,
        )
        return lost

    async def close(self) -> None:
        """Unsubscribe (before draining the connection, which would otherwise wait)."""
        sub, self._sub = self._sub, None
        if sub is not None and not self.bus.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("unsubscribe failed: %s", exc)

    async def _fetch_raw(self, batch: int, timeout: float) -> list[Msg]:
        async with self._lock:
            if self._lost_check:
                self._lost_check = False
                try:
                    await self._recover_lost()
                except Exception:
                    self._lost_check = True  # the connection went again: at the next fetch
                    raise
            if self._sub is None:
                await self.start()
            assert self._sub is not None
            try:
                msgs = await self._sub.fetch(batch, timeout=timeout)
            except (TimeoutError, NatsTimeout):
                msgs = []  # nothing pending: nats-py raises on an empty fetch
            except Exception:
                # the consumer has no leader (a server of its cluster died): what that server
                # was handing over may be lost without this connection being made again
                self._lost_check = self._held is not None
                raise
        record_queue_depth(self.bus.service, self.durable or self.filter_subject, _pending(msgs))
        return msgs

    async def _decode_or_reject(self, msg: Msg, delivery: Delivery) -> T | None:
        try:
            return decode(msg.data, self.event_type, delivery.headers.get("Content-Type"))
        except DecodeError as exc:
            await delivery.term()
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            return None

    async def fetch(
        self, batch: int | None = None, timeout: float | None = None
    ) -> list[tuple[T, Delivery]]:
        """Fetch up to ``batch`` messages and decode them; the caller acks each when done.

        Messages that do not decode are terminated and reported here and never returned.
        """
        out: list[tuple[T, Delivery]] = []
        for msg in await self._fetch_raw(
            batch or self.batch, self.fetch_timeout if timeout is None else timeout
        ):
            delivery = _delivery(msg, self.bus, self)
            event = await self._decode_or_reject(msg, delivery)
            if event is not None:
                out.append((event, delivery))
        return out

    async def handle(self, msg: Msg, handler: Handler[T]) -> None:
        delivery = _delivery(msg, self.bus, self)
        remote = trace.get_current_span(delivery.context).get_span_context()
        with self._tracer.start_as_current_span(
            f"handle {msg.subject}",
            context=delivery.context,
            kind=SpanKind.CONSUMER,
            links=[Link(remote)] if remote.is_valid else None,
            attributes={
                "messaging.destination": msg.subject,
                "messaging.delivery": delivery.num_delivered,
            },
        ) as span:
            event = await self._decode_or_reject(msg, delivery)
            if event is None:
                span.set_status(Status(StatusCode.ERROR, "invalid message"))
                return
            try:
                await handler(event, delivery)
            except Reject as exc:
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                await delivery.term()
                await self.bus.report_invalid(msg.subject, str(exc), msg.data)
                return
            except Retry as exc:
                log.info(
                    "%s: retrying %s in %.1fs: %s", self.bus.service, msg.subject, exc.delay, exc
                )
                await delivery.nak(delay=exc.delay)
                return
            except Exception as exc:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, str(exc)))
                log.exception(
                    "%s: handler failed on %s; will redeliver", self.bus.service, msg.subject
                )
                await delivery.nak(delay=min(30.0, 0.5 * delivery.num_delivered))
                return
            await delivery.ack()

    async def run(self, handler: Handler[T], stop: asyncio.Event) -> None:
        """Fetch and handle messages until ``stop`` is set; each is settled before the next
        fetch, so what a reconnect lost comes back at once (:meth:`recover_on_reconnect`)."""
        self.recover_on_reconnect()
        await self.start()
        while not stop.is_set():
            try:
                msgs = await self._fetch_raw(self.batch, self.fetch_timeout)
            except ConnectionClosedError:
                break
            except Exception as exc:  # reconnecting: the next fetch will work again
                log.debug("%s: fetch failed: %s", self.bus.service, exc)
                await asyncio.sleep(0.2)
                continue
            for msg in msgs:
                await self.handle(msg, handler)
