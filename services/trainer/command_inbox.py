"""Training commands on rank 0: receiving them from NATS and answering them.

:class:`CommandInbox` subscribes to ``plexrl.train.>``, decodes each request, answers at once
what does not decode or comes on a subject that names no command (with the request id it could
read), answers ``checkpoints`` requests at once (they touch run directories, not the model:
:mod:`services.trainer.checkpoint_files`), and queues the rest for the trainer's next step
boundary, where :class:`~services.trainer.commands.CommandRunner` executes them. See
:mod:`services.trainer.commands` for what each command does and which checks apply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.msg import Msg

from schemas.codec import DecodeError, Format, content_type, decode, encode, is_msgpack, salvage_id
from schemas.events import ServiceError
from schemas.training import (
    TRAIN_COMMANDS,
    TRAIN_WILDCARD,
    CheckpointsRequest,
    CheckpointsResult,
    ForwardBackwardResult,
    LoadWeightsResult,
    OptimStepResult,
    SaveWeightsResult,
    TrainRequest,
    TrainResult,
    parse_train_subject,
)
from services.bus import Bus, flushed, tracing
from services.trainer.checkpoint_files import CheckpointFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Command:
    """One decoded training command and the tenant of the subject it came on."""

    kind: str
    tenant: str
    request: TrainRequest
    trace: dict[str, str] = field(default_factory=dict)
    """the request's trace headers (``traceparent``...): the trainer's spans continue its trace"""


_RESULTS: dict[str, Callable[..., TrainResult]] = {
    "forward_backward": ForwardBackwardResult,
    "optim_step": OptimStepResult,
    "save_weights": SaveWeightsResult,
    "load_weights": LoadWeightsResult,
    "checkpoints": CheckpointsResult,
}
assert set(_RESULTS) == set(TRAIN_COMMANDS)


def failure(command: Command, error: str) -> TrainResult:
    """The command's result type saying ``error``."""
    req = command.request
    return _RESULTS[command.kind](request_id=req.request_id, run_id=req.run_id, error=error)


class CommandInbox:
    """The commands that arrived since the trainer last looked, with where to answer them."""

    def __init__(
        self, bus: Bus, wake: Callable[[], None], checkpoints: CheckpointFiles | None = None
    ) -> None:
        self.bus = bus
        self._wake = wake
        self.checkpoints = checkpoints
        self._answering: set[asyncio.Task[None]] = set()
        self._pending: list[tuple[Command, Msg]] = []
        self._sub: Any = None

    async def start(self) -> None:
        self._sub = await self.bus.nc.subscribe(TRAIN_WILDCARD, cb=self._on_msg)
        await flushed(self.bus.nc)

    async def stop(self) -> None:
        """Unsubscribe and answer what is still queued: the trainer is going away."""
        if self._sub is not None and not self.bus.nc.is_closed:
            try:
                await self._sub.unsubscribe()
            except Exception as exc:
                log.debug("unsubscribe failed: %s", exc)
        self._sub = None
        if self._answering:
            await asyncio.gather(*self._answering, return_exceptions=True)
        pending, self._pending = self._pending, []
        for command, msg in pending:
            await self._reply(msg, failure(command, "the trainer is shutting down; send it again"))

    def pending(self) -> bool:
        return bool(self._pending)

    def take(self) -> list[tuple[Command, Msg]]:
        taken, self._pending = self._pending, []
        return taken

    async def answer(self, taken: list[tuple[Command, Msg]], results: list[TrainResult]) -> None:
        for (command, msg), result in zip(taken, results, strict=True):
            if result.error is not None and result.error == wrong_tenant(command):
                # another tenant's credentials aimed at this run: worth an operator's eye
                log.warning("trainer: refused a command on %s: %s", msg.subject, result.error)
                await self.bus.report_invalid(msg.subject, result.error, msg.data)
            await self._reply(msg, result)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            tenant, kind = parse_train_subject(msg.subject)
        except ValueError as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            if msg.reply:
                await self._reply(msg, _not_a_command(msg, str(exc), self.bus.service))
            return
        request_type: type[Any] = TRAIN_COMMANDS[kind][0]
        if not msg.reply:
            await self.bus.report_invalid(
                msg.subject, f"a {request_type.__name__} needs a reply subject", msg.data
            )
            return
        headers = dict(msg.headers or {})
        try:
            request: TrainRequest = decode(msg.data, request_type, headers.get("Content-Type"))
        except DecodeError as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            error = f"invalid {request_type.__name__}: {exc}"
            await self._reply(
                msg,
                _RESULTS[kind](
                    request_id=salvage_id(msg.data),
                    run_id=salvage_id(msg.data, "run_id"),
                    error=error,
                ),
            )
            return
        if isinstance(request, CheckpointsRequest):
            task = asyncio.create_task(self._answer_checkpoints(tenant, request, msg))
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)
            return
        trace = {k: v for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")}
        self._pending.append((Command(kind, tenant, request, trace), msg))
        self._wake()

    async def _answer_checkpoints(self, tenant: str, req: CheckpointsRequest, msg: Msg) -> None:
        if self.checkpoints is None:
            result = CheckpointsResult(
                request_id=req.request_id, run_id=req.run_id, error="this trainer keeps no runs"
            )
        else:
            try:
                result = await self.checkpoints.answer(tenant, req)
            except Exception as exc:  # a failing read answers its caller, it never kills us
                log.exception("trainer: checkpoints %s failed", req.request_id)
                result = CheckpointsResult(
                    request_id=req.request_id,
                    run_id=req.run_id,
                    error=f"checkpoints failed: {type(exc).__name__}: {exc}",
                )
        await self._reply(msg, result)

    async def _reply(self, msg: Msg, result: msgspec.Struct) -> None:
        fmt: Format = "msgpack" if is_msgpack((msg.headers or {}).get("Content-Type")) else "json"
        try:
            headers = tracing.inject({"Content-Type": content_type(fmt)})
            await self.bus.nc.publish(msg.reply, encode(result, fmt), headers=headers)
        except Exception as exc:  # the requester may be gone; a retry gets the stored result
            log.warning("trainer: could not answer %s: %s", msg.subject, exc)


def _not_a_command(msg: Msg, error: str, service: str) -> msgspec.Struct:
    """The answer to a request on a subject that names no command of a legal tenant, so that
    its sender learns why instead of waiting out its timeout: the result type of the command
    the subject ends in, else a ServiceError."""
    kind = msg.subject.rsplit(".", 1)[-1]
    if kind in _RESULTS:
        return _RESULTS[kind](
            request_id=salvage_id(msg.data), run_id=salvage_id(msg.data, "run_id"), error=error
        )
    return ServiceError(service=service, error=error)


def wrong_tenant(command: Command) -> str:
    return f"{command.request.run_id} does not belong to tenant {command.tenant}"
