"""The gateway's side of the bus: the run table, run submission, generation and training commands.

Every HTTP route reaches plexrl through one :class:`Backend`, which holds nothing a restart
would lose: runs live in the registry, adapters and optimizers in the trainer, loaded weights in
inference. It acts for one tenant and uses that tenant's subjects only, on a connection with that
tenant's credentials (:mod:`services.gateway.tenancy`), so the broker bounds what an HTTP client
can reach. Each request's work is bounded (prompts, completions, tokens) before it is sent.

Failures come back as :class:`GatewayError`, which carries the HTTP status and a message that
says what was wrong; each API renders it in its own error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError

from schemas.codec import DecodeError, decode, encode
from schemas.config import ConfigError, orch_config_from_dict
from schemas.events import (
    Event,
    EvictRequested,
    GenerateCancel,
    GenerateRequest,
    GenerateResponse,
    RunConfigInvalid,
    RunRow,
    RunSubmitted,
    WeightsReady,
)
from schemas.records import HOLDING_STATUSES
from schemas.subjects import (
    WEIGHTS_STREAM,
    generate_subject,
    runs_subject,
    tenant_weights_subject,
)
from schemas.training import train_subject
from services.bus import Bus
from services.bus.last import last_message
from services.gateway.admission import Admission, Ticket
from services.gateway.errors import GatewayError
from services.gateway.run_table import RunTable
from services.gateway.settings import GatewaySettings
from services.runs.table import RunListFailed, list_runs

__all__ = ["Backend", "GatewayError", "ModelRef"]

log = logging.getLogger(__name__)


def config_digest(config: dict[str, Any]) -> str:
    """The digest the registry gives ``config`` (RunRow.config_digest); "" for a config that
    does not validate (the registry refuses it, and says why)."""
    try:
        return orch_config_from_dict(config).digest()
    except ConfigError:
        return ""


R = TypeVar("R", bound=Event)

RUN_ID = re.compile(r"^run_[A-Za-z0-9_-]{1,64}$")
RETRY_PAUSE_S = 0.2

# Conditions an inference replica reports that pass by themselves: a run its mirror has not
# applied yet, a version not loaded yet, a busy or restarting replica.
_TRANSIENT = re.compile(
    r"not (yet )?(loaded|available|known|ready)|(loaded|available|known|ready) yet|"
    r"unknown run|no adapter|not serving|busy|overloaded|try again|shutting down|draining",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class ModelRef:
    """What an API ``model`` names: a run and the oldest policy version it may answer with, or
    exactly that version (``exact``: ``run_x@N``), or the base model (no run)."""

    run_id: str
    min_version: int = 0
    is_base: bool = False
    exact: bool = False


def run_id_for(session_id: str, model_seq_id: int) -> str:
    """The run of a Tinker training client: derived from its session and ``model_seq_id``."""
    digest = hashlib.sha256(f"{session_id}/{model_seq_id}".encode()).hexdigest()
    return f"run_tk_{digest[:20]}"


def sdk_model_run(model: str) -> str:
    """``model`` with the id the Tinker SDK derives for a training client it created from a
    saved state (``<session>:train:<model_seq_id>``) replaced by its run's id."""
    session, _, seq = model.rpartition(":train:")
    return run_id_for(session, int(seq)) if session and seq.isdigit() else model


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Backend:
    """The bus operations behind every route (see the module docstring)."""

    def __init__(
        self,
        bus: Bus,
        settings: GatewaySettings,
        tenant: str,
        base_run_id: str | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.tenant = tenant
        self.base_run_id = base_run_id or settings.base_run_id
        """the label of this tenant's base-model requests (they need no run)"""
        self.admission = admission or Admission(
            settings.max_inflight_requests, settings.max_inflight_tokens, settings.retry_after_s
        )
        """the gateway's bound on generation under way, shared by every tenant's backend"""
        self.table = RunTable(bus, tenant)
        self._giving_up: set[asyncio.Task[None]] = set()

    # --- runs -------------------------------------------------------------------------------

    async def runs(self) -> list[RunRow]:
        """The runs this tenant may see, from the registry."""
        with _registry_errors():
            return await list_runs(self.bus, self.tenant, timeout=5.0)

    async def run(self, run_id: str) -> RunRow | None:
        """``run_id``'s row, from the run table this gateway follows (run_table.py)."""
        with _registry_errors():
            return await self.table.row(run_id)

    async def listed_run(self, run_id: str) -> RunRow | None:
        """``run_id``'s row as the registry lists it now (its progress included)."""
        return next((r for r in await self.runs() if r.run_id == run_id), None)

    async def submit(self, run_id: str, config: dict[str, Any], by: str) -> RunRow:
        """Submit a run and wait until the registry gives it an index (or refuses it).

        A config the registry refuses (a rank above its limit, say) is announced as a
        RunConfigInvalid and never becomes a row of the run list, so the refusal is listened
        for while waiting: it is a 400 with the registry's reason at once.
        """
        refused: list[str] = []

        async def on_invalid(msg: Msg) -> None:
            try:
                event: RunConfigInvalid = decode(
                    msg.data, RunConfigInvalid, (msg.headers or {}).get("Content-Type")
                )
            except DecodeError:
                return  # the registry's word; a garbled copy is not ours to judge
            if event.run_id == run_id:
                refused.append(event.error)

        sub = await self.bus.nc.subscribe(runs_subject("invalid", self.tenant), cb=on_invalid)
        try:
            event = RunSubmitted(run_id=run_id, config=config, submitted_by=by)
            subject = runs_subject("submit", self.tenant)
            try:
                await self.bus.publish(
                    subject, event, msg_id=f"{run_id}/submit/{uuid.uuid4().hex}", full_wait=0
                )
            except APIError as exc:  # with accounts the registry answers a tenant's submit
                raise GatewayError(
                    400, f"the registry refused {run_id}: {exc.description}", "refused"
                ) from None
            return await self.wait_active(run_id, refused, config_digest(config))
        finally:
            await sub.unsubscribe()

    async def wait_active(
        self, run_id: str, refused: list[str] | None = None, digest: str = ""
    ) -> RunRow:
        """The run's row once it is active; a 400 once ``refused`` holds the registry's reason,
        the row says it was refused or, given the ``digest`` of the config submitted, holds
        another config (the run id was taken with it); a 503 after ``create_timeout_s``."""
        deadline = time.monotonic() + self.settings.create_timeout_s
        row: RunRow | None = None
        while time.monotonic() < deadline:
            if refused:
                raise GatewayError(400, f"the registry refused {run_id}: {refused[0]}", "refused")
            row = await self.listed_run(run_id)
            taken = row.config_digest if row is not None and row.status in HOLDING_STATUSES else ""
            if digest and taken not in ("", digest):
                raise GatewayError(
                    400,
                    f"{run_id} already exists with a different config (registry: "
                    f"{taken}, given: {digest}); use another model id",
                    "refused",
                )
            if row is not None and row.status == "active":
                return row
            if row is not None and row.status in ("invalid", "evicted", "forgotten"):
                raise GatewayError(
                    400, f"the registry refused {run_id} ({row.status}): {row.detail}", "refused"
                )
            await asyncio.sleep(RETRY_PAUSE_S)
        state = "is waiting for a free run slot" if row is not None else "was never registered"
        if row is not None and row.status == "waiting":
            self.give_up(run_id)  # a client that gave up must not take the next free slot
        raise GatewayError(
            503,
            f"{run_id} {state} after {self.settings.create_timeout_s:g}s, so it left the "
            "queue; free a slot (evict a run, or finish a session) or retry later",
            "unavailable",
        )

    def give_up(self, run_id: str) -> None:
        """Take a queued run out of the queue and delete it (its id is free again)."""
        task = asyncio.create_task(self._give_up(run_id), name=f"give up {run_id}")
        self._giving_up.add(task)
        task.add_done_callback(self._giving_up.discard)

    async def _give_up(self, run_id: str) -> None:
        try:
            await self.evict(run_id, "its client gave up waiting for a free run slot")
            deadline = time.monotonic() + 30.0
            while time.monotonic() < deadline:
                row = await self.listed_run(run_id)
                if row is None or row.status in ("evicted", "invalid"):
                    break
                await asyncio.sleep(RETRY_PAUSE_S)
            await self.evict(run_id, "deleted: never admitted", delete=True)
        except (GatewayError, NatsTimeout, NoRespondersError) as exc:
            log.warning("gateway: could not take %s out of the queue: %s", run_id, exc)

    async def evict(self, run_id: str, reason: str, *, delete: bool = False) -> None:
        """Ask the registry to evict ``run_id`` (with ``delete``: to delete the evicted run's
        directory, checkpoints included, freeing its id)."""
        event = EvictRequested(
            run_id=run_id, reason=reason[:16000], requested_by="gateway", delete=delete
        )
        what = "delete" if delete else "evict"
        try:
            await self.bus.publish(
                runs_subject("evict", self.tenant),
                event,
                msg_id=f"{run_id}/{what}/{uuid.uuid4().hex}",
                full_wait=0,
            )
        except APIError as exc:
            raise GatewayError(
                400, f"the registry refused to {what} {run_id}: {exc.description}", "refused"
            ) from None

    async def resolve(self, model: str) -> ModelRef:
        """The run and version a ``model`` name stands for; 404 when there is none.

        ``run_x`` is the newest adapter inference holds, ``run_x@12`` exactly version 12, and
        the base model's name (or the base label) the base model itself, which needs no run."""
        if not model:
            raise GatewayError(400, "`model` is required: a run id, run_id@version or the base")
        if model == self.settings.base_name() or model == self.base_run_id:
            return ModelRef(self.base_run_id, 0, is_base=True)
        name, _, version_text = model.partition("@")
        run_id = sdk_model_run(name)
        if not RUN_ID.match(run_id):
            raise GatewayError(
                404,
                f"model {model!r} does not exist: name a run (run_<id>, run_<id>@<version>) or "
                f"the base model {self.settings.base_name()!r}; GET /v1/models lists them",
                "model_not_found",
            )
        version = 0
        if version_text:
            if not version_text.isdigit():
                raise GatewayError(
                    404,
                    f"model {model!r}: the version after '@' must be a number",
                    "model_not_found",
                )
            version = int(version_text)
        row = await self.run(run_id)
        if row is None or row.status != "active":
            status = "does not exist" if row is None else f"is {row.status}"
            raise GatewayError(404, f"model {run_id!r} {status}", "model_not_found")
        if row.tenant != self.tenant:  # a default-tenant gateway sees every run: serve its own
            raise GatewayError(404, f"model {run_id!r} does not exist", "model_not_found")
        if version > 0:
            published = await self.published_version(run_id)
            if version > published:
                row = await self.listed_run(run_id) or row  # its progress, for the message
                raise GatewayError(
                    404,
                    f"model {model!r} is not available: the newest weights {run_id} has "
                    f"published are version {published} (it has reached step {row.step or 0})",
                    "model_not_found",
                )
        return ModelRef(run_id, version, exact=bool(version_text))

    async def published_version(self, run_id: str) -> int:
        """The version of the run's newest WeightsReady (0, the base, when it has none)."""
        subject = tenant_weights_subject(run_id, self.tenant)
        stored = await last_message(self.bus, WEIGHTS_STREAM, subject)
        if stored is None:
            return 0
        return decode(stored.data, WeightsReady, stored.headers.get("Content-Type")).step

    # --- generation ---------------------------------------------------------------------------

    async def generate(
        self,
        ref: ModelRef,
        prompts: list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
        top_k: int = 0,
        top_logprobs: int = 0,
        prompt_logprobs: bool = False,
        ignore_eos: bool = False,
        ticket: Ticket | None = None,
    ) -> GenerateResponse:
        """Completions from inference, retried while the condition is transient. A request of
        more prompts than ``max_prompts`` or more than ``max_request_tokens`` tokens to
        generate (prompts x n x max_tokens) is a 400 naming the limit; one past the gateway's
        bound on generation under way (admission.py: ``ticket`` when the caller took one
        already) or refused by an overloaded replica is a 429 with a retry-after. ``ref`` says
        what generates them: a run's newest version, exactly one version, or the base model.
        Cancelled (its HTTP client left, a Tinker sample was cancelled), it tells inference to
        drop the request."""
        self.check_work(len(prompts), n, max_tokens)
        if ticket is None:
            ticket = self.admission.admit(len(prompts), n, max_tokens)
        timeout = self.settings.request_timeout_s
        with ticket:
            request = GenerateRequest(
                request_id=new_request_id("gw"),
                run_id=ref.run_id,
                prompts=prompts,
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                min_policy_version=ref.min_version,
                seed=seed,
                timeout_s=min(timeout, 3600.0),
                prompt_logprobs=prompt_logprobs,
                top_logprobs=top_logprobs,
                top_k=top_k,
                ignore_eos=ignore_eos,
                exact_version=ref.exact,
                base_model=ref.is_base,
                deadline=time.time() + timeout,
                source="http",
            )
            try:
                return await self._generate(request, timeout)
            except asyncio.CancelledError:
                self._cancel(request.request_id)
                raise

    async def _generate(self, request: GenerateRequest, timeout: float) -> GenerateResponse:
        subject = generate_subject(self.tenant)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                answer = await self.bus.request(
                    subject, request, GenerateResponse, timeout=max(left, 0.1)
                )
            except NoRespondersError:
                reason = "no inference replica is running"
            except NatsTimeout:
                reason = f"inference did not answer within {timeout:g}s"
            else:
                if answer.error is None:
                    return answer
                if answer.error_code == "overloaded":
                    raise GatewayError(
                        429,
                        f"inference is at its bound: {answer.error}",
                        "overloaded",
                        retry_after=answer.retry_after_s or self.settings.retry_after_s,
                    )
                if answer.error_code == "deadline_exceeded":
                    raise GatewayError(
                        504, f"inference did not finish within {timeout:g}s", "timeout"
                    )
                if not _TRANSIENT.search(answer.error):
                    raise GatewayError(400, f"inference refused the request: {answer.error}")
                reason = f"inference: {answer.error}"
            if time.monotonic() + RETRY_PAUSE_S >= deadline:
                raise GatewayError(503, reason, "unavailable")
            await asyncio.sleep(RETRY_PAUSE_S)

    def _cancel(self, request_id: str) -> None:
        """Tell inference that nobody waits for ``request_id`` any more (fire and forget)."""

        async def send() -> None:
            cancel = GenerateCancel(request_id=request_id, reason="the HTTP client gave up")
            try:
                await self.bus.nc.publish(generate_subject(self.tenant, "cancel"), encode(cancel))
            except Exception as exc:  # a closing connection: the deadline still ends it
                log.debug("gateway: could not cancel %s: %s", request_id, exc)

        task = asyncio.create_task(send(), name=f"cancel {request_id}")
        self._giving_up.add(task)
        task.add_done_callback(self._giving_up.discard)

    def check_work(self, num_prompts: int, n: int, max_tokens: int) -> None:
        settings = self.settings
        if num_prompts > settings.max_prompts:
            raise GatewayError(
                400,
                f"{num_prompts} prompts in one request: this gateway takes at most "
                f"{settings.max_prompts} (max_prompts)",
            )
        work = num_prompts * n * max_tokens
        if work > settings.max_request_tokens:
            raise GatewayError(
                400,
                f"prompts x n x max_tokens = {num_prompts} x {n} x {max_tokens} = {work} tokens "
                f"to generate, over this gateway's limit of {settings.max_request_tokens} per "
                "request (max_request_tokens): split it or ask for fewer",
            )

    # --- training commands --------------------------------------------------------------------

    async def train(self, kind: str, request: Event, result_type: type[R]) -> R:
        """Send one training command and return its result. A trainer that is not listening
        yet (restarting) is waited for; retries reuse the request id, so none applies twice."""
        subject = train_subject(kind, self.tenant)
        timeout = self.settings.request_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return await self.bus.request(subject, request, result_type, timeout=max(left, 0.1))
            except NoRespondersError:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise GatewayError(
                        503, "no trainer answers training commands", "unavailable"
                    ) from None
            except NatsTimeout:
                raise GatewayError(
                    504, f"the trainer did not answer {kind} within {timeout:g}s", "timeout"
                ) from None
            except msgspec.ValidationError as exc:
                raise GatewayError(502, f"the trainer's answer to {kind}: {exc}") from exc
            await asyncio.sleep(RETRY_PAUSE_S)


def commands_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` for a run trained by explicit commands (when the run config knows them)."""
    from schemas.config import OrchConfig

    if "driver" in OrchConfig.model_fields:
        return {**config, "driver": "commands"}
    return config


@contextlib.contextmanager
def _registry_errors() -> Iterator[None]:
    """The registry's run list failing, as the gateway answers it."""
    try:
        yield
    except (NatsTimeout, NoRespondersError) as exc:
        raise GatewayError(
            503, "no registry answers the run list; is `plexrl registry` running?", "unavailable"
        ) from exc
    except RunListFailed as exc:
        raise GatewayError(502, str(exc), "registry_error") from exc
