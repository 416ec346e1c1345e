"""The registry service: the one owner of run identity (the reference MultiRunManager's master).

Runs arrive two ways with the same result: a ``run_*`` directory under ``output_dir`` holding
``control/orch.toml`` (found by a periodic or on-demand scan), or a ``RunSubmitted`` event on
``plexrl.runs.submit`` (the registry writes the directory and its ``orch.toml``, then treats it
exactly like a scanned one). A valid run takes the lowest free index of the pool or waits for
one, oldest first; an invalid one gets ``control/config_validation_error.txt`` and is retried
when its file changes; ``EvictRequested`` (or an ``evicted.txt`` written by hand) evicts; a
vanished directory is forgotten. Each change is announced on ``PLEXRL_RUNS``; the order in
which files, KV and the stream are written is the ledger's (see :mod:`.ledger`).

Every run belongs to a tenant: the one whose subject its first submit came on
(``plexrl.runs.<tenant>.submit``; the broker vouches for the token), or the default tenant for
``plexrl.runs.submit`` and for runs found on the filesystem. A tenant's submit is checked against
its quotas (:mod:`.tenancy`), may not take a run id another tenant owns, and a tenant evicts only
its own runs (the default tenant may evict any). Free indices go to waiting runs by fair share
across tenants (:mod:`.fair_share`). The registry also answers ``plexrl.registry[.<tenant>].list``
(:mod:`.listing`) and, with accounts, tenants' writes (:mod:`.ingest`), and keeps each tenant's
views of its runs' events in the tenant's account (:mod:`services.tenants.views`). It reads the
tenants file again when it changes.

One lock serialises every state change, so a scan, a submit and an eviction never interleave.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from schemas import subjects as sj
from schemas.config import dump_toml
from schemas.events import EvictRequested, RunConfigInvalid, RunSubmitted
from schemas.records import RunRecord
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus, Consumer, Delivery, Reject
from services.config.tenants import TenantsFile, TenantsFileError, load_tenants
from services.launch.faults import crash_point
from services.registry import discovery as fs
from services.registry.ingest import Ingest
from services.registry.ledger import Ledger, RegistryError
from services.registry.listing import RunListService
from services.registry.removal import HOLDING, Removals
from services.registry.settings import RegistrySettings
from services.registry.tenancy import foreign_owner, quota_refusal, unknown_tenant
from services.registry.validation import Validator, Verdict, file_digest, make_validator

__all__ = ["Registry", "RegistryError"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_HOLDING = HOLDING


class Registry(Removals):
    """Discovers, validates, indexes, evicts and forgets runs; see the module docstring."""

    def __init__(
        self,
        bus: Bus,
        settings: RegistrySettings,
        *,
        validator: Validator | None = None,
        tenants: TenantsFile | None = None,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.output_dir = settings.output_dir
        # DeploymentError for a model whose LoRA targets the trainer cannot wrap (the CLI makes
        # the validator first: exit status 2)
        self.validator = validator or make_validator(
            settings.max_lora_rank,
            settings.max_async_level,
            settings.validation_hooks,
            model=settings.model,
            target_modules=settings.target_modules,
        )
        # TenantsFileError for a file that does not load (the CLI loads it first: exit status 2)
        self.tenants = tenants if tenants is not None else load_tenants(settings.tenants_file)
        if settings.tenants_file is not None and not settings.tenants_file.exists():
            log.warning(
                "registry: no tenants file at %s yet: only the default tenant",
                settings.tenants_file,
            )
        self._tenants_stamp = _stamp(settings.tenants_file)
        self.ledger = Ledger(bus, settings.max_runs, lambda t: self.tenants.quota(t).max_runs)
        self.listing = RunListService(bus, lambda: list(self.ledger.records.values()))
        self.ingest = Ingest(bus, self, settings.ingest_max_request_bytes)
        self._stamps: dict[str, tuple[int, int, int] | None] = {}  # orch.toml as last read
        self._reported: set[str] = set()
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._scan_wanted = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._consumers: list[Consumer[Any]] = []

    # --- read side -------------------------------------------------------------------------

    @property
    def records(self) -> dict[str, RunRecord]:
        """A snapshot of the table: run_id -> record (forgotten runs included)."""
        return {k: msgspec.structs.replace(v) for k, v in self.ledger.records.items()}

    def idx_of(self, run_id: str) -> int | None:
        return self.pool.idx_of(run_id)

    def run_id_of(self, idx: int) -> str | None:
        return self.pool.run_id_of(idx)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Restore the table, publish what a crash left owed, scan, then serve the consumers."""
        async with self._lock:
            await self.ledger.open()
            await self._scan_locked()  # publishes what a crash left owed first
        name = self.settings.consumer_name
        # One durable consumer per subject form: the default tenant's subjects keep their names
        # (and their consumers) from before tenants existed.
        for suffix, subject, event_type, handler in (
            ("submit", sj.SUBMIT, RunSubmitted, self._on_submit),
            ("evict", sj.EVICT, EvictRequested, self._on_evict),
            ("submit-tenants", sj.SUBMIT_TENANTS, RunSubmitted, self._on_submit),
            ("evict-tenants", sj.EVICT_TENANTS, EvictRequested, self._on_evict),
        ):
            consumer: Consumer[Any] = Consumer(
                self.bus,
                stream=sj.RUNS_STREAM,
                durable=f"{name}-{suffix}",
                filter_subject=subject,
                event_type=event_type,
                ack_wait=10.0,  # a crashed registry's message goes to its successor soon
                fetch_timeout=0.25,
            )
            await consumer.start()
            self._consumers.append(consumer)
            self._tasks.append(asyncio.create_task(consumer.run(handler, self._stop)))
        self._tasks.append(asyncio.create_task(self._scan_loop()))
        await self.listing.start()
        for tenant in sorted(self.tenants.tenants):
            await self.ingest.ensure_views(tenant)
        await self.ingest.start()
        held = sum(r.status in _HOLDING for r in self.ledger.records.values())
        log.info(
            "registry: serving %s (%d runs held, max_runs=%d, %d tenants besides the default)",
            self.output_dir,
            held,
            self.settings.max_runs,
            len(self.tenants.tenants),
        )

    async def stop(self) -> None:
        self._stop.set()
        self._scan_wanted.set()
        await self.ingest.stop()
        await self.listing.stop()
        tasks, self._tasks = self._tasks, []
        # Holding the lock, no state change is cut in half; a message whose handler is still
        # waiting for the lock is not acknowledged and goes to the next registry instead.
        async with self._lock:
            for task in tasks:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for consumer in self._consumers:
            await consumer.close()
        self._consumers.clear()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set."""
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    def request_scan(self) -> None:
        """Scan as soon as possible instead of at the next interval."""
        self._scan_wanted.set()

    async def scan(self) -> None:
        """Scan ``output_dir`` now and apply every change found."""
        await self._serialised(self._scan_locked())

    async def submit(
        self, event: RunSubmitted, stream_seq: int = 0, tenant: str = DEFAULT_TENANT
    ) -> None:
        """Apply a RunSubmitted from ``tenant`` (``stream_seq`` makes a redelivered one a no-op)."""
        await self._serialised(self._submit_locked(event, stream_seq, tenant))

    async def evict(
        self, run_id: str, reason: str, requested_by: str = "", tenant: str = DEFAULT_TENANT
    ) -> bool:
        """Evict ``run_id`` for ``tenant``; False (and a ServiceError report) if no such run is
        known or it belongs to another tenant (the default tenant may evict any run)."""
        return await self._serialised(self._evict_locked(run_id, reason, requested_by, tenant))

    async def _serialised(self, work: Coroutine[Any, Any, T]) -> T:
        async with self._lock:
            try:
                if self.ledger.stale:  # an earlier failure: the table is the truth, reload it
                    await self.ledger.open()
                    self._stamps.clear()
                return await work
            except Exception:
                # A failed KV write or publish leaves memory ahead of the table; nothing runs on
                # it until it is reloaded (above, by the next piece of work, which raises while
                # NATS is away). The next scan then publishes anything left owed.
                work.close()
                self.ledger.stale = True
                raise

    async def _on_submit(self, event: RunSubmitted, delivery: Delivery) -> None:
        await self.submit(event, delivery.stream_sequence, _tenant_of(delivery))

    async def _on_evict(self, event: EvictRequested, delivery: Delivery) -> None:
        tenant = _tenant_of(delivery)
        if event.delete:
            await self._serialised(self._delete_locked(event.run_id, event.requested_by, tenant))
            return
        await self.evict(event.run_id, event.reason, event.requested_by, tenant)

    async def reload_tenants(self) -> None:
        """Read the tenants file again if it changed, and keep the views of new tenants."""
        stamp = _stamp(self.settings.tenants_file)
        if stamp == self._tenants_stamp:
            return
        self._tenants_stamp = stamp
        try:
            tenants = load_tenants(self.settings.tenants_file)
        except TenantsFileError as exc:
            log.error("registry: keeping the tenants it had: %s", exc)
            return
        added = sorted(set(tenants.tenants) - set(self.tenants.tenants))
        self.tenants = tenants
        log.info("registry: tenants file reloaded (%d tenants)", len(tenants.tenants))
        for tenant in added:
            await self.ingest.ensure_views(tenant)

    async def _scan_loop(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._scan_wanted.wait(), self.settings.scan_interval)
            except TimeoutError:
                pass
            self._scan_wanted.clear()
            if self._stop.is_set():
                break
            try:
                await self.reload_tenants()
                await self.scan()
            except Exception:
                log.exception("registry: scan of %s failed; retrying later", self.output_dir)

    # --- the scan --------------------------------------------------------------------------

    async def _scan_locked(self) -> None:
        await self.ledger.flush_owed()
        result = await asyncio.to_thread(fs.scan_output_dir, self.output_dir)
        for name, why in result.skipped.items():
            if name not in self._reported:
                self._reported.add(name)
                log.warning("registry: %s", why)
                await self.bus.report_error(why, directory=name)
        for rec in list(self.ledger.records.values()):
            if rec.status != "forgotten" and rec.run_id not in result.runs:
                await self._forget(rec)
        # Oldest config first, so runs found in one scan wait in the order they were written.
        found = sorted(result.runs.values(), key=lambda s: ((s.stamp or (0,))[0], s.run_id))
        for state in found:
            try:
                await self._reconcile(state)
            except OSError as exc:  # one unreadable or unwritable directory must not stop the rest
                log.error("registry: cannot process %s: %s", state.path, exc)
        await self.ledger.settle()

    async def _reconcile(
        self, state: fs.RunDirState, submit_seq: int = 0, tenant: str = DEFAULT_TENANT
    ) -> None:
        """Bring one run's record in line with its directory (new valid runs are only queued:
        the caller settles them). A run not held yet becomes ``tenant``'s: the submitter's, or
        the default tenant for a directory found by a scan."""
        run_id = state.run_id
        rec = self.ledger.get(run_id)
        live = rec if rec is not None and rec.status in _HOLDING else None
        if state.evicted:
            if live is not None:  # evicted.txt written by hand, or by us just before a crash
                reason = fs.read_evicted_reason(self.output_dir, run_id)
                await self._mark_evicted(live, reason)
            return
        if live is not None and live.status == "active":
            if self._stamps.setdefault(run_id, state.stamp) != state.stamp:
                self._stamps[run_id] = state.stamp
                log.warning(
                    "registry: %s: control/orch.toml changed while the run is active; the run "
                    "keeps the config it was discovered with (evict it and submit a new run id "
                    "to change it)",
                    run_id,
                )
            return
        if not state.has_config:
            return  # not a run yet
        if live is not None and not submit_seq and self._stamps.get(run_id) == state.stamp:
            return  # orch.toml untouched since we last read it
        data = await asyncio.to_thread(fs.read_config_bytes, self.output_dir, run_id)
        if data is None:
            return  # removed while we looked; the next scan forgets the run
        self._stamps[run_id] = state.stamp
        digest = file_digest(data)
        verdict = self.validator.check_bytes(data)
        # a run never seen is like one forgotten at transition 0
        base = rec or RunRecord(run_id=run_id, status="forgotten")
        if live is None:
            base = msgspec.structs.replace(base, tenant=tenant)
        if verdict.config is None:
            await self._mark_invalid(base, live, verdict.error, digest, submit_seq)
            return
        await asyncio.to_thread(fs.clear_validation_error, self.output_dir, run_id)
        config, config_digest = verdict.config.to_dict(), verdict.digest
        if live is not None and live.status == "waiting":  # keeps its place in the queue
            if (live.config_digest, live.file_digest) != (config_digest, digest):
                live.config, live.config_digest, live.file_digest = config, config_digest, digest
                await self.ledger.save(live)
            return
        self.ledger.stage_waiting(
            base.next(
                "waiting",
                config=config,
                config_digest=config_digest,
                file_digest=digest,
                queued_at=time.time_ns(),
                submit_seq=submit_seq,
                source="submit" if submit_seq else "scan",
            )
        )

    async def _mark_invalid(
        self, base: RunRecord, live: RunRecord | None, error: str, digest: str, submit_seq: int
    ) -> None:
        if live is not None and (live.status, live.file_digest, live.error) == (
            "invalid",
            digest,
            error,
        ):
            return  # nothing new to say
        run_id = base.run_id
        await asyncio.to_thread(fs.write_validation_error, self.output_dir, run_id, error)
        crash_point("registry.error_txt", run_id)
        if live is not None and live.status == "waiting":
            self.pool.dequeue(run_id)
        log.info("registry: %s is invalid: %s", run_id, error)
        new = base.next("invalid", error=error, file_digest=digest, submit_seq=submit_seq)
        await self.ledger.commit(new)

    # --- submit and evict ------------------------------------------------------------------

    async def _submit_locked(self, event: RunSubmitted, seq: int, tenant: str) -> None:
        run_id = event.run_id
        rec = self.ledger.get(run_id)
        if seq and rec is not None and rec.submit_seq >= seq:
            return  # a redelivery, or a replay of a submit already applied
        if not self.tenants.knows(tenant):
            await self._refuse_submit(run_id, tenant, unknown_tenant(tenant), seq)
            return
        if fs.run_dir(self.output_dir, run_id).is_symlink():
            await self._refuse(
                run_id,
                f"cannot create {run_id}: {self.output_dir / run_id} is a symbolic link; a run "
                "directory must be a real directory inside output_dir",
            )
            return
        state = fs.inspect_run_dir(self.output_dir, run_id)
        if rec is not None and rec.status in _HOLDING and state is None:
            await self._forget(rec)  # deleted since the last scan: the id is free again
            rec = self.ledger.get(run_id)
        if (owner := foreign_owner(rec, tenant)) is not None:
            # The owner's record and index stay as they are; the requester learns only that the
            # id is taken, the operators (plexrl.errors.registry) by whom.
            error = f"run id {run_id} is taken; choose another run id"
            await self._refuse_submit(run_id, tenant, error, seq)
            why = f"refused a submit of {run_id} by tenant {tenant}: it belongs to tenant {owner}"
            await self._refuse(None, why, run=run_id, tenant=tenant, owner=owner)
            return
        verdict = self.validator.check_submission(event.config)
        if rec is not None and rec.status in ("active", "waiting"):
            if verdict.ok and verdict.digest == rec.config_digest:
                return  # the same run submitted again
            await self._report_conflict(run_id, rec.config_digest, verdict)
            return
        if state is not None and state.evicted:
            reason = fs.read_evicted_reason(self.output_dir, run_id)
            await self._refuse(
                run_id,
                f"{run_id} was evicted ({reason}) and is never rediscovered; choose another run "
                f"id, or delete {state.path} to reuse this one",
            )
            return
        if verdict.config is None:
            short = seq or hashlib.sha256(msgspec.json.encode(event.config)).hexdigest()[:16]
            log.info("registry: submitted %s is invalid: %s", run_id, verdict.error)
            await self.bus.publish(
                sj.runs_subject("invalid", tenant),
                RunConfigInvalid(run_id=run_id, error=verdict.error[:16000], tenant=tenant),
                msg_id=f"{run_id}/invalid/submit/{short}",
            )
            return
        existing = None
        if state is not None and state.has_config:
            data = await asyncio.to_thread(fs.read_config_bytes, self.output_dir, run_id)
            existing = self.validator.check_bytes(data) if data is not None else None
        if existing is not None and existing.ok and existing.digest != verdict.digest:
            # an orch.toml the scan has not picked up yet: it was there first
            await self._report_conflict(run_id, existing.digest, verdict)
            return
        records = self.ledger.records.values()
        refusal = quota_refusal(tenant, verdict.config, self.tenants, records, self.pool.num_free)
        if refusal is not None:
            await self._refuse_submit(run_id, tenant, refusal, seq)
            return
        if existing is None or not existing.ok:
            text = dump_toml(verdict.config.to_dict())
            await asyncio.to_thread(fs.write_config, self.output_dir, run_id, text)
            crash_point("registry.orch_toml", run_id)
        state = fs.inspect_run_dir(self.output_dir, run_id)
        if state is not None:
            await self._reconcile(state, submit_seq=seq or 1, tenant=tenant)
            await self.ledger.settle()

    async def _report_conflict(self, run_id: str, have: str, verdict: Verdict) -> None:
        other = verdict.digest or f"an invalid config: {verdict.error}"
        await self._refuse(
            run_id,
            f"{run_id} already exists with a different config (digest {have} vs {other}); "
            "evict it or choose another run id",
        )

    async def _refuse_submit(self, run_id: str, tenant: str, error: str, seq: int) -> None:
        """Refuse ``tenant``'s submit: a RunConfigInvalid on the tenant's own invalid subject."""
        log.warning("registry: refused %s for tenant %s: %s", run_id, tenant, error)
        # a redelivered submit refuses under the same id; every other refusal is new
        mid = f"{run_id}/refused/{tenant}/{seq or uuid.uuid4().hex}"
        event = RunConfigInvalid(run_id=run_id, error=error[:16000], tenant=tenant)
        await self.bus.publish(sj.runs_subject("invalid", tenant), event, msg_id=mid)


def _stamp(path: Path | None) -> tuple[int, int] | None:
    """When and how big the tenants file was last written (None: no file)."""
    try:
        st = path.stat() if path is not None else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st is not None else None


def _tenant_of(delivery: Delivery) -> str:
    """The tenant of a request: its subject's tenant token, never a field of the body."""
    try:
        return sj.tenant_of_subject(delivery.subject)
    except ValueError as exc:
        raise Reject(f"no usable tenant in subject {delivery.subject!r}: {exc}") from None
