"""The run list service: the registry answers ``plexrl.registry[.<tenant>].list``.

A :class:`~schemas.events.RunListRequest` on ``plexrl.registry.list`` (the default tenant, which
services and operators use) gets every run; on ``plexrl.registry.<tenant>.list`` only that
tenant's runs. The tenant comes from the subject, which the broker's permissions vouch for,
never from the body. Each row joins the registry's record with the run's progress in KV
``plexrl-progress``: a tenant's credentials cannot read the KV buckets, so this is how a tenant
sees its runs.

A request that does not decode (or an unusable subject) is answered with a ``RunList`` whose
``error`` says why, so the requester gets a clear answer instead of a timeout, and it is also
reported as an ``InvalidMessage`` on ``plexrl.errors.<service>``. A request without a reply
subject can only be reported. An empty body is a request with the defaults (every status).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas import subjects as sj
from schemas.codec import DecodeError, Format, content_type, decode, encode, is_msgpack
from schemas.events import RunList, RunListRequest, RunRow
from schemas.records import Progress, RunRecord
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus, flushed, tracing
from services.runs.progress import read_progress

log = logging.getLogger(__name__)

BAD_REQUEST = "not a valid RunListRequest"
"""how the error of a RunList answering a request that does not decode begins"""

_ORDER = {"active": 0, "waiting": 1, "invalid": 2, "evicted": 3, "forgotten": 4}


def visible_rows(
    records: list[RunRecord],
    progress: dict[str, Progress | None],
    tenant: str,
    statuses: list[str],
) -> list[RunRow]:
    """The rows ``tenant`` may see (all of them for the default tenant), active runs first."""
    rows = []
    for rec in records:
        if tenant != DEFAULT_TENANT and rec.tenant != tenant:
            continue
        if statuses and rec.status not in statuses:
            continue
        p = progress.get(rec.run_id)
        rows.append(
            RunRow(
                run_id=rec.run_id,
                tenant=rec.tenant,
                status=rec.status,
                idx=rec.idx,
                step=p.step if p else None,
                total_tokens=p.total_tokens if p else None,
                total_samples=p.total_samples if p else None,
                reward_mean=p.reward_mean if p else None,
                updated_at=max(rec.updated_at, p.updated_at if p else 0.0),
                detail=(rec.error or rec.reason)[:1000],
                config_digest=rec.config_digest,
                labels=_labels(rec),
            )
        )
    rows.sort(key=lambda r: (_ORDER.get(r.status, 9), -1 if r.idx is None else r.idx, r.run_id))
    return rows


def _labels(rec: RunRecord) -> dict[str, str]:
    labels = (rec.config or {}).get("labels")
    if not isinstance(labels, dict):
        return {}
    return {str(k): str(v) for k, v in labels.items()}


class RunListService:
    """Answers run list requests from a snapshot of the registry's records."""

    def __init__(self, bus: Bus, records: Callable[[], list[RunRecord]]) -> None:
        self.bus = bus
        self.records = records
        self._subs: list[Subscription] = []

    async def start(self) -> None:
        for subject in (sj.REGISTRY_LIST, sj.REGISTRY_LIST_TENANTS):
            self._subs.append(await self.bus.nc.subscribe(subject, cb=self._on_request))
        await flushed(self.bus.nc)  # a request sent after start() finds a responder

    async def stop(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            if not self.bus.nc.is_closed:
                try:
                    await sub.unsubscribe()
                except Exception as exc:
                    log.debug("registry: unsubscribe failed: %s", exc)

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            await self.bus.report_invalid(
                msg.subject, "a RunListRequest needs a reply subject (use request/reply)", msg.data
            )
            return
        headers = dict(msg.headers or {})
        try:
            answer = await self.answer(msg.subject, msg.data, headers.get("Content-Type"))
        except Exception as exc:  # a KV read failed: say so rather than leave the caller waiting
            log.exception("registry: cannot answer %s", msg.subject)
            answer = RunList(error=f"the registry could not read the run table: {exc}")
        if (answer.error or "").startswith(BAD_REQUEST):
            await self.bus.report_invalid(msg.subject, answer.error or "", msg.data)
        fmt: Format = "msgpack" if is_msgpack(headers.get("Content-Type")) else "json"
        data = encode(answer, fmt)
        limit = self.bus.nc.max_payload or 0
        if limit and len(data) > limit:
            answer = RunList(
                tenant=answer.tenant,
                error=f"{len(answer.runs)} runs make a reply of {len(data)} bytes, over the "
                f"server's max_payload of {limit}: ask for fewer statuses",
            )
            data = encode(answer, fmt)
        await self.bus.nc.publish(
            msg.reply, data, headers=tracing.inject({"Content-Type": content_type(fmt)})
        )

    async def answer(self, subject: str, data: bytes, ctype: str | None = None) -> RunList:
        """The reply to a request ``data`` received on ``subject``."""
        try:
            tenant = sj.tenant_of_subject(subject)
        except ValueError as exc:
            return RunList(error=f"{BAD_REQUEST}: {exc}")
        request = RunListRequest()
        if data.strip():
            try:
                request = decode(data, RunListRequest, ctype)
            except DecodeError as exc:
                return RunList(tenant=tenant, error=f"{BAD_REQUEST}: {exc}")
        records = self.records()
        shown = [r for r in records if tenant == DEFAULT_TENANT or r.tenant == tenant]
        progress = await _progress_of([r.run_id for r in shown], self.bus)
        return RunList(
            tenant=tenant, runs=visible_rows(shown, progress, tenant, list(request.statuses))
        )


async def _progress_of(run_ids: list[str], bus: Bus) -> dict[str, Progress | None]:
    async def one(run_id: str) -> Progress | None:
        try:
            return await read_progress(bus, run_id)
        except DecodeError as exc:  # one unreadable value must not hide the whole table
            log.warning("registry: unreadable progress of %s: %s", run_id, exc)
            return None

    found = await asyncio.gather(*(one(r) for r in run_ids))
    return dict(zip(run_ids, found, strict=True))
