"""The inference service: GenerateRequest in, GenerateResponse out, one adapter per run.

- Requests arrive on ``plexrl.inference.generate`` and on each tenant's
  ``plexrl.inference.<tenant>.generate``, in queue group ``inference`` (core NATS
  request/reply), so replicas share them; each reply carries the ``Plexrl-Replica`` header. A
  request on a tenant's subject for a run of another tenant is answered with an error and
  reported, and nothing is generated; the default tenant's subject may name any run.
- A :class:`~services.runs.mirror.RunMirror` keeps the engine's slots in step with the
  registry: a run created gets a fresh adapter (policy version 0, the base model's behaviour), a
  run removed is forgotten.
- A :class:`WeightsFollower` loads each announced adapter and hands it to the engine. An adapter
  announced for a run this replica does not know yet is held back (the newest per run) and loaded
  when the run is created.
- Full weights (``kind == "full"``, a trainer started with ``--full-weights``) are installed
  into the engine's base model in place; from then on this replica serves that run only (its
  requests generate with no adapter) and answers requests of any other run with an error
  saying so. While a failed load has left the parameters partly written, the run's requests
  wait as for a version not yet loaded, and a timeout says why.
- With ``weight_transport="collective"`` the replica joins the trainer's broadcast group at
  start-up (a :class:`~services.weights.collective.CollectiveReceiver`, leaving it on stop) and
  receives the adapters that WeightsReady events of transport ``collective`` name through it.
- A request waits, up to its ``timeout_s``, until the engine can serve its
  ``min_policy_version``; the reply says which version generated it. A bad request gets an error
  reply (a malformed one is also reported on ``plexrl.errors.<service>``); nothing a request
  holds can stop the service.
- A request naming a ``progress_subject`` (an inbox of its tenant) hears GenerateProgress there
  until its reply is sent (progress.py). A copy of a request (sent again after a reconnect) is
  generated once (answers.py). Load (admission.py, schedule.py): HTTP sampling past the
  replica's bound is refused at once; a request past its deadline or cancelled is dropped;
  rollouts are scheduled first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from schemas import subjects as sj
from schemas.codec import DecodeError, decode, salvage_id
from schemas.events import GenerateRequest, GenerateResponse, WeightsReady
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus, flushed, tracing
from services.inference.admission import Held, HttpBound, past_deadline, wait_limit
from services.inference.answers import Answers, request_key
from services.inference.exact import ExactVersions, base_generation
from services.inference.jobs import (
    DeadlineExceeded,
    Engine,
    JobResult,
    LoadInto,
    SlotChanged,
    job_of,
)
from services.inference.progress import ProgressBeacon, beaconed
from services.inference.requests import (
    RequestFailed,
    WrongTenant,
    check_progress,
    check_request,
    failure,
    request_format,
    request_seed,
    send_reply,
)
from services.inference.weights_follower import WeightsFollower
from services.model.routing import NO_ADAPTER
from services.runs.mirror import RunMirror
from services.telemetry.metrics import record_request_served, record_weight_sync
from services.weights.collective import CollectiveReceiver
from services.weights.transport import WeightFetcher

log = logging.getLogger(__name__)


SYNC_INTERVAL = 0.1
"""Seconds between two applications of the run mirror's buffered lifecycle events."""


class InferenceService:
    """One inference replica: an engine, a run mirror, a weights follower and the request loop."""

    def __init__(
        self,
        bus: Bus,
        engine: Engine,
        *,
        max_runs: int,
        replica_name: str,
        output_dir: Path | None = None,
        weight_load_attempts: int = 2,
        shutdown_grace: float = 30.0,
        weight_transport: str = "object_store",
        max_request_tokens: int = 1 << 22,
        http_bound: HttpBound | None = None,
    ) -> None:
        self.bus = bus
        self.http_bound = http_bound or HttpBound(1 << 30, 1 << 62, 1.0)
        self.held = Held(bus)
        self.engine = engine
        self.replica_name = replica_name
        self.max_request_tokens = max_request_tokens
        self.shutdown_grace = shutdown_grace
        self.mirror = RunMirror(bus, max_runs, service=bus.service)
        self.receiver: CollectiveReceiver | None = None
        fetchers: dict[str, WeightFetcher] = {}
        if weight_transport == "collective":
            # Full weights land in the parameters as the broadcast arrives: never mid-batch.
            self.receiver = CollectiveReceiver(bus, replica_name, write_guard=engine.write_guard)
            fetchers["collective"] = self.receiver
        self.follower = WeightsFollower(
            bus,
            wanted=self._wants,
            install=self._install,
            install_full=self._install_full,
            output_dir=output_dir,
            attempts=weight_load_attempts,
            fetchers=fetchers,
            tenant_of=self.mirror.tenant_of,
        )
        self.exact = ExactVersions(bus, engine, self.follower.load)
        self.served: Counter[str] = Counter()
        """Requests answered with completions, per run."""
        self.answers = Answers()
        """one generation per request, however often it arrives"""
        self.errors = 0
        self.ignored_versions = 0
        """Announced adapters not newer than what the run already had."""
        self.installed_at: dict[tuple[str, int], float] = {}
        """``time.monotonic()`` at which each (run, version) became available here."""
        self._unservable: dict[str, str] = {}
        # Announcements for runs not known yet, per run and announcing tenant.
        self._held: dict[str, dict[str, tuple[WeightsReady, dict[str, str]]]] = {}
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._subs: list[Any] = []
        self._sync_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._tracer = tracing.tracer(f"plexrl.{bus.service}")

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.engine.set_listener(self._notify)
        await self.engine.start()
        self.mirror.register_deletion_hook(self._on_run_deleted)
        self.mirror.register_creation_hook(self._on_run_created)
        await self.mirror.start()
        await self.mirror.wait_until_caught_up()
        await self.mirror.synchronize_state()
        self._sync_task = asyncio.create_task(self._sync_loop(), name="inference-mirror-sync")
        if self.receiver is not None:
            # Joining goes on in the background: the trainer may start after this replica.
            await self.receiver.start()
        await self.follower.start()
        for subject in (sj.GENERATE, sj.GENERATE_TENANTS):
            self._subs.append(
                await self.bus.nc.subscribe(
                    subject, queue=sj.INFERENCE_QUEUE_GROUP, cb=self._on_request
                )
            )
        for subject in (sj.CANCEL, sj.CANCEL_TENANTS):  # every replica hears every cancel
            self._subs.append(await self.bus.nc.subscribe(subject, cb=self.held.on_cancel))
        # Once the server has the subscription, a request sent after start() finds a responder.
        await flushed(self.bus.nc)
        log.info(
            "inference replica %s serving %s and %s",
            self.replica_name,
            sj.GENERATE,
            sj.GENERATE_TENANTS,
        )

    async def stop(self) -> None:
        """Stop taking requests, let those in flight finish (up to the grace period), close.

        Requests still waiting for a policy version are answered at once with an error, so their
        senders can retry on another replica instead of waiting out their timeout.
        """
        self._stopping = True
        self._notify()
        subs, self._subs = self._subs, []
        for sub in subs:
            if self.bus.nc.is_closed:
                break
            try:
                await sub.unsubscribe()
            except Exception as exc:
                log.debug("unsubscribe failed: %s", exc)
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=self.shutdown_grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._sync_task is not None:
            self._sync_task.cancel()
            await asyncio.gather(self._sync_task, return_exceptions=True)
        await self.follower.stop()
        if self.receiver is not None:
            await self.receiver.close()
        await self.mirror.stop()
        await self.engine.close()

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()

    def _notify(self) -> None:
        """An available version changed: wake every waiting request to look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- runs --------------------------------------------------------------------------------

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(SYNC_INTERVAL)
            try:
                await self.mirror.synchronize_state()
            except Exception:  # a failing hook must not stop the mirror for good
                log.exception("applying run lifecycle events failed")

    def _on_run_created(self, idx: int, run_id: str) -> None:
        lora = self.mirror.config(idx).model.lora
        try:
            self.engine.add_run(idx, run_id, lora.rank, lora.alpha)
        except ValueError as exc:
            self._unservable[run_id] = f"{run_id} cannot be served by this replica: {exc}"
            self._spawn(self.bus.report_error(self._unservable[run_id], run_id=run_id, idx=idx))
            return
        self._unservable.pop(run_id, None)
        owner = self.mirror.tenant_of(run_id) or DEFAULT_TENANT
        for tenant, (event, headers) in self._held.pop(run_id, {}).items():
            if tenant == owner:
                self.follower.submit(event, headers, tenant)
            else:
                self._spawn(self.follower.refuse(event, tenant))

    def _on_run_deleted(self, idx: int, run_id: str) -> None:
        self.engine.remove_run(idx, run_id)
        self.answers.forget(run_id)
        self._unservable.pop(run_id, None)
        self._held.pop(run_id, None)

    async def _slot_of(self, run_id: str) -> int | None:
        """The run's slot; an unknown run makes the mirror catch up with the stream first."""
        slot = self.mirror.idx_of(run_id)
        if slot is None:
            try:
                await self.mirror.wait_until_caught_up(timeout=2.0)
            except Exception as exc:  # an unreachable server: answer with what we know
                log.debug("mirror catch-up failed: %s", exc)
            await self.mirror.synchronize_state()
            slot = self.mirror.idx_of(run_id)
        return slot

    # --- weights -----------------------------------------------------------------------------

    def _wants(self, event: WeightsReady, headers: dict[str, str], tenant: str) -> bool:
        slot = self.mirror.idx_of(event.run_id)
        if slot is None:
            # Held with its headers, so the load joins the publisher's trace when it happens;
            # one per announcing tenant, as only the run's own counts once it is known.
            by_tenant = self._held.setdefault(event.run_id, {})
            held = by_tenant.get(tenant)
            if held is None or held[0].step < event.step:
                by_tenant[tenant] = (event, headers)
            return False
        if event.run_id in self._unservable:
            return False
        version = self.engine.available_version(slot, event.run_id)
        if version is not None and event.step <= version:
            self.ignored_versions += 1
            log.info("%s: version %d ignored, %d is loaded", event.run_id, event.step, version)
            return False
        return True

    async def _install(self, event: WeightsReady, tensors: dict[str, Any]) -> None:
        slot = self.mirror.idx_of(event.run_id)
        if slot is not None:  # None: removed while its adapter was loading
            self._installed(event, await self.engine.load_adapter(slot, event, tensors))

    async def _install_full(self, event: WeightsReady, load: LoadInto) -> None:
        if self.mirror.idx_of(event.run_id) is not None:  # None: removed while the event waited
            self.answers.forget()  # whatever it was answered from is being overwritten
            self._installed(event, await self.engine.install_full(event, load))

    def _installed(self, event: WeightsReady, installed: bool) -> None:
        if not installed:
            self.ignored_versions += 1
            return
        if len(self.installed_at) >= 4096:  # a bounded record: forget the oldest half
            for key in list(self.installed_at)[:2048]:
                del self.installed_at[key]
        self.installed_at[(event.run_id, event.step)] = now = time.monotonic()
        log.info("%s: version %d loaded", event.run_id, event.step)
        published = self.follower.published_at.get((event.run_id, event.step))
        if published is not None:
            tenant = self.mirror.tenant_of(event.run_id) or DEFAULT_TENANT
            record_weight_sync(event.run_id, now - published, tenant=tenant)

    # --- requests ----------------------------------------------------------------------------

    async def _on_request(self, msg: Msg) -> None:
        if not msg.reply:
            await self.bus.report_invalid(
                msg.subject, "a GenerateRequest needs a reply subject (use request/reply)", msg.data
            )
            return
        try:
            sj.tenant_of_subject(msg.subject)  # the tenants' wildcard takes any token
        except ValueError as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            response = failure(salvage_id(msg.data), "", f"invalid GenerateRequest: {exc}")
            await self._reply(msg, response, dict(msg.headers or {}))
            return
        # The subscription handles one message at a time: serve each in its own task.
        self._spawn(self._serve(msg))

    async def _serve(self, msg: Msg) -> None:
        loop = asyncio.get_running_loop()
        received = loop.time()
        headers = dict(msg.headers or {})
        with self._tracer.start_as_current_span(
            "generate",
            context=tracing.extract(headers),
            kind=SpanKind.SERVER,
            attributes={"messaging.destination": msg.subject, "replica": self.replica_name},
        ) as span:
            response = await self._answer(msg.subject, msg.data, headers, span)
            tokens = sum(len(c.token_ids) for group in response.completions for c in group)
            record_request_served(
                response.run_id,
                ok=response.error is None,
                tenant=self.mirror.tenant_of(response.run_id) or sj.tenant_of_subject(msg.subject),
                seconds=loop.time() - received,
                tokens=tokens,
            )
            if response.error is not None:
                self.errors += 1
                span.set_status(Status(StatusCode.ERROR, response.error))
            await self._reply(msg, response, headers)

    async def _answer(
        self, subject: str, data: bytes, headers: dict[str, str], span: Span
    ) -> GenerateResponse:
        tenant = sj.tenant_of_subject(subject)  # _on_request answered the illegal ones
        try:
            req: GenerateRequest = decode(data, GenerateRequest, headers.get("Content-Type"))
            check_request(
                req, self.engine.vocab_size, self.engine.max_model_len, self.max_request_tokens
            )
            check_progress(req, tenant)
        except (DecodeError, RequestFailed) as exc:
            await self.bus.report_invalid(subject, str(exc), data)
            return failure(salvage_id(data), "", f"invalid GenerateRequest: {exc}")
        span.set_attribute("run_id", req.run_id)
        span.set_attribute("request_id", req.request_id)
        span.set_attribute("tenant", tenant)
        fmt = request_format(headers)

        def progress() -> ProgressBeacon | contextlib.nullcontext[None]:  # a copy's, meanwhile
            if req.progress_subject is None:
                return contextlib.nullcontext()
            return ProgressBeacon(self.bus.nc, req, self.replica_name, fmt, "generating")

        return await self.answers.answer(
            request_key(tenant, req),
            lambda: self._respond(req, tenant, subject, data, span, headers),
            progress,
        )

    async def _respond(
        self,
        req: GenerateRequest,
        tenant: str,
        subject: str,
        data: bytes,
        span: Span,
        headers: dict[str, str],
    ) -> GenerateResponse:
        try:
            held = await self.held.run(
                req,
                tenant,
                self.http_bound,
                lambda: beaconed(
                    self.bus.nc, req, self.replica_name, headers, self._generate, tenant
                ),
            )
        except WrongTenant as exc:
            log.warning("refused a generate request on %s: %s", subject, exc)
            await self.bus.report_invalid(subject, str(exc), data)
            return failure(req.request_id, req.run_id, str(exc))
        except RequestFailed as exc:
            return failure(req.request_id, req.run_id, str(exc))
        except Exception as exc:  # a failing batch answers its requests, it never kills us
            log.exception("generation failed for %s", req.request_id)
            return failure(req.request_id, req.run_id, f"generation failed: {exc}")
        if isinstance(held, GenerateResponse):
            return held  # refused at arrival, cancelled, or past its deadline
        slot, result = held
        self.served[req.run_id] += 1
        span.set_attribute("idx", slot)
        span.set_attribute("policy_version", result.policy_version)
        span.set_attribute("tokens", result.num_tokens)
        return GenerateResponse(
            request_id=req.request_id,
            run_id=req.run_id,
            policy_version=result.policy_version,
            completions=result.completions,
            prompt_logprobs=result.prompt_logprobs,
        )

    async def _generate(
        self, req: GenerateRequest, tenant: str, beacon: ProgressBeacon | None
    ) -> tuple[int, JobResult]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_limit(req)
        seed = request_seed(req.seed)
        while True:
            changed = self._changed
            if self._stopping:
                raise RequestFailed(
                    f"inference replica {self.replica_name} is shutting down; send the request "
                    "again (another replica can serve it)"
                )
            if req.base_model:
                return NO_ADAPTER, await base_generation(
                    self.engine, self.replica_name, req, tenant, seed, beacon
                )
            slot = await self._slot_of(req.run_id)
            if slot is None:
                raise RequestFailed(
                    f"unknown run {req.run_id}: no run with this id is registered here (submit "
                    "it first, or check that it was not evicted)"
                )
            owner = self.mirror.tenant_of(req.run_id)
            if tenant != DEFAULT_TENANT and owner != tenant:
                raise WrongTenant(f"{req.run_id} does not belong to tenant {tenant}")
            if req.run_id in self._unservable:
                raise RequestFailed(self._unservable[req.run_id])
            full = self.engine.full_weights
            if full is not None and full.run_id != req.run_id:
                raise RequestFailed(
                    f"{req.run_id} cannot be served by inference replica {self.replica_name}: "
                    f"its base model carries the full weights of {full.run_id} (trained with "
                    "--full-weights), so it serves that run only; send requests of other runs "
                    "to replicas that do not follow a full-weights trainer"
                )
            version = self.engine.available_version(slot, req.run_id)
            serving: int | None = slot
            if req.exact_version:
                serving = await self.exact.slot(req, slot, version, owner or DEFAULT_TENANT)
            if serving is not None and version is not None and version >= req.min_policy_version:
                job = job_of(req, serving, seed, tenant)
                if beacon is not None:
                    beacon.state = "generating"
                try:
                    return slot, await self.engine.generate(job)
                except SlotChanged:
                    if beacon is not None:
                        beacon.state = "waiting_for_version"
                    continue
            remaining = deadline - loop.time()
            if remaining <= 0 and past_deadline(req):
                raise DeadlineExceeded(f"{req.request_id}: its deadline passed while it waited")
            if remaining <= 0:
                have = "no version" if version is None else f"policy version {version}"
                why = f" ({full.reason})" if full is not None and full.reason else ""
                raise RequestFailed(
                    f"{req.run_id}: this replica has {have}{why} but the request asks for "
                    f"min_policy_version {req.min_policy_version}; gave up after waiting "
                    f"{req.timeout_s:g}s (timeout_s) for it to be published and loaded"
                )
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass

    async def _reply(self, msg: Msg, response: GenerateResponse, headers: dict[str, str]) -> None:
        try:
            await send_reply(self.bus.nc, msg.reply, response, headers, self.replica_name)
        except Exception as exc:  # the requester's connection may be gone; nothing to retry
            log.warning("could not reply to %s: %s", response.request_id or "?", exc)
