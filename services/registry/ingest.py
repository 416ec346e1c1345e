"""The registry answers tenants' writes: submits, evicts and rollouts, checked, then stored.

With accounts, a tenant's JetStream publish on ``plexrl.runs.<t>.submit``, ``.evict`` or
``plexrl.rollouts.<t>.<run_id>`` arrives here as a request on an ingest subject
(:mod:`schemas.ingest`) whose tenant token the broker wrote. The registry checks it and, if it
passes, stores it on the stream subject of the same name in the services account, under a
message id prefixed by the tenant, and answers with the stream's own acknowledgement. A refusal
is answered as JetStream answers a refused publish (``{"error": {"code", "err_code",
"description"}}``), so the tenant's client raises an error that says why, and nothing is stored.

What is checked before anything is stored:

- **submit**: the tenant is known, the body is a RunSubmitted of at most
  ``ingest_max_request_bytes``, the run id is not another tenant's, the config validates, and
  the tenant's quotas allow a new run (:mod:`.tenancy`). A run the tenant already holds with the
  same config is answered as a duplicate without storing anything. The tenant's views are made
  sure of first (:mod:`services.tenants.views`), so it hears what happens to its run.
- **evict**: the run is the tenant's (and, to delete it, evicted or invalid already).
- **rollouts**: the run is the tenant's, active and trained by rollouts, and the stream holds
  fewer of its batches than it can need (``ckpt.interval + max_async_level + 2``: the trainer
  keeps trained batches until a checkpoint holds them), so a tenant stores at most that much per
  run, and runs only within its quotas.

The consumer that applies a submit or an evict checks everything again under the registry's
lock (a quota may fill between the two). Every refusal is logged; none is an error report, since
a tenant can send as many as it likes.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from schemas import subjects as sj
from schemas.codec import DecodeError, decode
from schemas.events import EvictRequested, RunSubmitted
from schemas.ingest import (
    INGEST_QUEUE_GROUP,
    INGEST_WILDCARD,
    IngestSubject,
    ingest_msg_id,
    parse_ingest_subject,
)
from schemas.records import RunRecord
from services.bus import Bus, flushed
from services.registry.tenancy import foreign_owner, gets_index, quota_refusal, unknown_tenant
from services.tenants.views import ViewsUnavailable, ensure_views

if TYPE_CHECKING:
    from services.registry.service import Registry

log = logging.getLogger(__name__)

VIEWS_FRESH_S = 60.0
"""how long a tenant's views count as made sure of before a submit checks them again"""

PENDING_S = 60.0
"""how long a stored submit counts against its tenant's quotas before the registry's consumer
has applied it (after that the run table says what became of it)"""

FORWARDED = ("Content-Type", "traceparent", "tracestate")


class Refused(Exception):
    """A write the registry does not store: ``code`` is the HTTP-like status of the answer."""

    def __init__(self, code: int, description: str) -> None:
        super().__init__(description)
        self.code = code
        self.description = description


def refusal(code: int, description: str, err_code: int | None = 0) -> bytes:
    """An answer in JetStream's shape for a refused publish. ``err_code`` None marks a
    condition worth retrying (a 503 without one is how clients recognise an unavailable
    JetStream)."""
    error: dict[str, Any] = {"code": code, "description": f"plexrl registry: {description}"}
    if err_code is not None:
        error["err_code"] = err_code
    return json.dumps(
        {"type": "io.nats.jetstream.api.v1.pub_ack_response", "error": error}
    ).encode()


class _Head(msgspec.Struct, kw_only=True):
    """The part of a RolloutBatch the ingest reads."""

    step: int


class Ingest:
    """Answers ``plexrl.ingest.>`` for the registry ``registry`` (see the module docstring)."""

    def __init__(self, bus: Bus, registry: Registry, max_request_bytes: int) -> None:
        self.bus = bus
        self.registry = registry
        self.max_request_bytes = max_request_bytes
        self._sub: Subscription | None = None
        self._views_checked: dict[str, float] = {}
        self._pending: dict[str, tuple[RunRecord, float]] = {}
        """submits stored and not yet applied, by run id: they count against their tenant's
        quotas, or a burst of submits would all pass before the consumer applies the first"""

    async def start(self) -> None:
        self._sub = await self.bus.nc.subscribe(
            INGEST_WILDCARD, queue=INGEST_QUEUE_GROUP, cb=self._on_msg
        )
        await flushed(self.bus.nc)

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and not self.bus.nc.is_closed:
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("registry: ingest unsubscribe failed: %s", exc)

    async def ensure_views(self, tenant: str) -> bool:
        """Create or restore ``tenant``'s views; False (with a warning) when its account's
        JetStream does not answer."""
        try:
            for change in await ensure_views(self.bus.nc, tenant):
                log.info("registry: %s", change)
        except ViewsUnavailable as exc:
            log.warning("registry: %s", exc)
            return False
        self._views_checked[tenant] = time.monotonic()
        return True

    async def _on_msg(self, msg: Msg) -> None:
        if not msg.reply:
            log.warning("registry: a write on %s without a reply subject, ignored", msg.subject)
            return
        try:
            where = parse_ingest_subject(msg.subject)
            answer = await self._store(where, msg)
        except Refused as exc:
            log.info("registry: refused %s: %s", msg.subject, exc.description)
            answer = refusal(exc.code, exc.description, None if exc.code == 503 else 0)
        except ValueError as exc:
            answer = refusal(400, str(exc))
        except Exception as exc:
            log.exception("registry: cannot store %s", msg.subject)
            answer = refusal(503, f"could not store the write ({type(exc).__name__}); retry", None)
        try:
            await msg.respond(answer)
        except Exception as exc:  # the requester's connection may be gone
            log.debug("registry: cannot answer %s: %s", msg.subject, exc)

    async def _store(self, where: IngestSubject, msg: Msg) -> bytes:
        tenant, headers = where.tenant, dict(msg.headers or {})
        submitted: RunRecord | None = None
        if not self.registry.tenants.knows(tenant):
            raise Refused(403, unknown_tenant(tenant))
        if where.kind == "rollouts":
            assert where.run_id is not None
            await self._check_rollouts(tenant, where.run_id, msg.data, headers)
            target = sj.tenant_rollouts_subject(where.run_id, tenant)
        else:
            if len(msg.data) > self.max_request_bytes:
                raise Refused(
                    413,
                    f"a {where.kind} request of {len(msg.data)} bytes is over the registry's "
                    f"limit of {self.max_request_bytes} (ingest_max_request_bytes)",
                )
            if where.kind == "submit":
                submitted = await self._check_submit(tenant, msg.data, headers)
                if submitted is None:
                    return json.dumps(
                        {"stream": sj.RUNS_STREAM, "seq": 0, "duplicate": True}
                    ).encode()
            else:
                self._check_evict(tenant, msg.data, headers)
            target = sj.runs_subject(where.kind, tenant)
        stored = {k: headers[k] for k in FORWARDED if k in headers}
        msg_id = ingest_msg_id(tenant, headers.get("Nats-Msg-Id"))
        if msg_id is not None:
            stored["Nats-Msg-Id"] = msg_id
        try:
            # sent again if the connection is made again meanwhile: the message id dedupes it
            what = f"registry: storing {tenant}'s {where.kind}"
            ack = await self.bus.reconnects.request(target, msg.data, 5.0, stored, what)
        except (NoRespondersError, NatsTimeout):
            raise Refused(503, "JetStream did not store the write in time; retry") from None
        if submitted is not None and b'"error"' not in ack.data:
            self._pending[submitted.run_id] = (submitted, time.monotonic())
        return bytes(ack.data)

    # --- the checks ----------------------------------------------------------------------

    def _record(self, tenant: str, run_id: str) -> RunRecord | None:
        """The tenant's record of ``run_id``; None also for another tenant's (a tenant learns
        nothing about runs that are not its own)."""
        rec = self.registry.ledger.get(run_id)
        if rec is None or rec.status == "forgotten" or rec.tenant != tenant:
            return None
        return rec

    async def _check_submit(
        self, tenant: str, data: bytes, headers: dict[str, str]
    ) -> RunRecord | None:
        """Refuse a submit that cannot succeed; None for one the registry already holds, else
        the record it will count as until the registry applies it."""
        try:
            event: RunSubmitted = decode(data, RunSubmitted, headers.get("Content-Type"))
        except DecodeError as exc:
            raise Refused(400, f"not a valid RunSubmitted: {exc}") from None
        reg, run_id = self.registry, event.run_id
        rec = reg.ledger.get(run_id)
        if foreign_owner(rec, tenant) is not None:
            raise Refused(409, f"run id {run_id} is taken; choose another run id")
        verdict = reg.validator.check_submission(event.config)
        pending = self._pending_records()
        if rec is None and run_id in pending:
            rec = pending[run_id]
        if rec is not None and rec.status in ("active", "waiting"):
            if verdict.ok and verdict.digest == rec.config_digest:
                return None
            raise Refused(
                409,
                f"{run_id} already exists with a different config (digest {rec.config_digest}); "
                "evict it or choose another run id",
            )
        if rec is not None and rec.status == "evicted":
            raise Refused(
                409,
                f"{run_id} was evicted ({rec.reason or 'no reason given'}); choose another run "
                f"id, or delete it first (plexrl evict {run_id} --delete)",
            )
        if verdict.config is None:
            raise Refused(400, f"invalid config: {verdict.error}")
        records = [*reg.ledger.records.values(), *pending.values()]
        num_free = reg.pool.num_free - sum(r.status == "active" for r in pending.values())
        why = quota_refusal(tenant, verdict.config, reg.tenants, records, max(num_free, 0))
        if why is not None:
            raise Refused(429, why)
        stale = time.monotonic() - self._views_checked.get(tenant, -VIEWS_FRESH_S) >= VIEWS_FRESH_S
        if stale and not await self.ensure_views(tenant):
            raise Refused(503, f"the views of tenant {tenant} cannot be kept yet; retry")
        starts = gets_index(tenant, reg.tenants, records, num_free)
        return RunRecord(
            run_id=run_id,
            status="active" if starts else "waiting",
            tenant=tenant,
            config_digest=verdict.digest,
        )

    def _pending_records(self) -> dict[str, RunRecord]:
        """The stored submits the registry has not applied yet (see ``_pending``)."""
        ledger, now = self.registry.ledger, time.monotonic()
        for run_id, (_, at) in list(self._pending.items()):
            rec = ledger.get(run_id)
            if now - at > PENDING_S or (rec is not None and rec.status != "forgotten"):
                del self._pending[run_id]
        return {run_id: rec for run_id, (rec, _) in self._pending.items()}

    def _check_evict(self, tenant: str, data: bytes, headers: dict[str, str]) -> None:
        try:
            event: EvictRequested = decode(data, EvictRequested, headers.get("Content-Type"))
        except DecodeError as exc:
            raise Refused(400, f"not a valid EvictRequested: {exc}") from None
        rec = self._record(tenant, event.run_id)
        if rec is None:
            raise Refused(404, f"tenant {tenant} has no run {event.run_id}")
        if event.delete and rec.status not in ("evicted", "invalid"):
            raise Refused(409, f"{event.run_id} is {rec.status}: evict it first, then delete it")

    async def _check_rollouts(
        self, tenant: str, run_id: str, data: bytes, headers: dict[str, str]
    ) -> None:
        rec = self._record(tenant, run_id)
        if rec is None or rec.status != "active":
            raise Refused(404, f"tenant {tenant} has no active run {run_id}")
        config = rec.config or {}
        if config.get("driver", "rollouts") != "rollouts":
            raise Refused(400, f"{run_id} is trained by commands; it takes no RolloutBatch")
        try:
            decode(data, _Head, headers.get("Content-Type"))
        except DecodeError as exc:
            raise Refused(400, f"not a valid RolloutBatch: {exc}") from None
        ckpt = config.get("ckpt") or {}
        room = int(ckpt.get("interval", 50)) + int(config.get("max_async_level", 1)) + 2
        subject = sj.tenant_rollouts_subject(run_id, tenant)
        info = await self.bus.js.stream_info(sj.ROLLOUTS_STREAM, subjects_filter=subject)
        held = (info.state.subjects or {}).get(subject, 0)
        if held >= room:
            raise Refused(
                429,
                f"the stream holds {held} batches of {run_id} the trainer has not committed "
                f"(at most {room}: ckpt.interval + max_async_level + 2); wait for the trainer",
            )
