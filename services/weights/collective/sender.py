"""The trainer's end of the collective transport: :class:`CollectiveSender`."""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import nats.errors
import torch
from nats.aio.msg import Msg

from schemas.codec import DecodeError, decode, encode
from schemas.collective import GroupFormed, GroupState, JoinRequest, LeaveRequest, Ping, Pong
from schemas.events import ServiceError
from schemas.run_id import validate_run_id
from schemas.subjects import collective_subjects
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus, flushed
from services.weights.collective.protocol import (
    DEFAULT_GROUP,
    HEARTBEAT,
    MAX_FORM_ATTEMPTS,
    PING_TIMEOUT,
    TIMEOUT,
    _EndFrame,
    _ForgetFrame,
    _Frame,
    _new_group,
    _ready_key,
    _send_frame,
    _send_stream,
    location,
)
from services.weights.errors import WeightsError
from services.weights.stream import EncodedStream

log = logging.getLogger(__name__)

_Request = TypeVar("_Request", JoinRequest, LeaveRequest)


@dataclass
class _Op:
    kind: str  # "send", "forget", "heartbeat", "wake" (membership changed), "close"
    run_id: str = ""
    step: int = 0
    steps: list[int] = field(default_factory=list)
    stream: EncodedStream | None = None
    done: asyncio.Future[str] | None = None


class CollectiveSender:
    """Rank 0 of every generation: hosts the store, forms groups, broadcasts every stream.

    ``host`` is the address replicas reach the store on and ``port`` its port (0 picks a free
    one; :attr:`port` then says which). ``bucket_bytes`` bounds each broadcast of data.
    """

    name = "collective"
    in_memory = True

    def __init__(
        self,
        bus: Bus,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_bytes: int = 32 << 20,
        *,
        group: str = DEFAULT_GROUP,
        timeout: float = TIMEOUT,
        heartbeat: float = HEARTBEAT,
        ping_timeout: float = PING_TIMEOUT,
    ) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if not 0 < heartbeat < timeout:
            raise ValueError(f"heartbeat ({heartbeat}s) must be positive and below the timeout")
        self.bus = bus
        self.host = host
        self.port = port
        self.bucket_bytes = bucket_bytes
        self.subjects = collective_subjects(group)
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.ping_timeout = ping_timeout
        self.sender_id = uuid.uuid4().hex[:12]
        self.generation = 0
        """The newest generation formed (0: none yet)."""
        self.members: list[str] = []
        """The members of the current generation in rank order (ranks 1, 2, ...)."""
        self._wanted: dict[str, str] = {}  # member -> replica, for the next generation
        self._dirty = False
        self._latest: dict[str, tuple[int, EncodedStream]] = {}
        self._ops: asyncio.Queue[_Op] = asyncio.Queue()
        self._pg: Any = None  # touched only on the executor's thread
        self._store: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._subs: list[Any] = []
        self._closed = False

    async def start(self) -> None:
        """Host the store and answer joins; replicas that ask get the current weights."""
        if self._task is not None:
            return
        if self._closed:
            raise RuntimeError("this CollectiveSender was closed; make a new one")
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="collective-send")
        try:
            self._store = await self._call(self._host_store)
        except RuntimeError:  # the port is taken, say: nothing is left running
            self._executor.shutdown()
            self._executor = None
            raise
        self._subs = [
            await self.bus.nc.subscribe(self.subjects.join, cb=self._on_join),
            await self.bus.nc.subscribe(self.subjects.leave, cb=self._on_leave),
        ]
        await flushed(self.bus.nc)
        self._task = asyncio.create_task(self._serve(), name="collective-sender")
        log.info("collective sender %s: store on %s:%d", self.sender_id, self.host, self.port)

    async def send(
        self,
        run_id: str,
        step: int,
        stream: EncodedStream,
        adapter_config: Any = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> str:
        """Broadcast ``stream`` to the current generation, keep it for later ones, say where.

        Returns once every member has it (or, when a member failed, once a new generation has
        the newest stream of every run). With no members it is only kept."""
        validate_run_id(run_id)
        op = _Op("send", run_id=run_id, step=step, stream=stream)
        return await self._submit(op)

    async def stored(self, run_id: str, *, tenant: str = DEFAULT_TENANT) -> set[int]:
        return set()  # this sender holds only what it was given since it started

    async def forget(
        self, run_id: str, steps: Collection[int], *, tenant: str = DEFAULT_TENANT
    ) -> set[int]:
        """Drop those steps here and on every member (the newest kept is dropped only if named)."""
        await self._submit(_Op("forget", run_id=run_id, steps=sorted(steps)))
        return set(steps)

    async def close(self) -> None:
        """End the generation (members go back to asking to join), stop hosting the store."""
        if self._closed:
            return
        self._closed = True
        for sub in self._subs:
            if not self.bus.nc.is_closed:
                await sub.unsubscribe()
        self._subs = []
        if self._task is not None:
            self._ops.put_nowait(_Op("close"))
            await self._task
            self._task = None
        if self._executor is not None:
            await self._call(self._drop_store)
            self._executor.shutdown(wait=True)
            self._executor = None

    # --- requests from replicas (event loop) --------------------------------------------------

    async def _on_join(self, msg: Msg) -> None:
        req = await self._decode(msg, JoinRequest)
        if req is not None:
            log.info("collective: %s (%s) asks to join", req.member, req.replica)
            self._wanted[req.member] = req.replica
            self._mark_dirty()
            await self._answer(msg)

    async def _on_leave(self, msg: Msg) -> None:
        req = await self._decode(msg, LeaveRequest)
        if req is None:
            return
        if self._wanted.pop(req.member, None) is not None or req.member in self.members:
            log.info("collective: %s leaves", req.member)
            self._mark_dirty()
        await self._answer(msg)

    async def _decode(self, msg: Msg, kind: type[_Request]) -> _Request | None:
        """The request ``msg`` carries (its member id checked by the schema), or None once
        reported as invalid and answered with a ServiceError saying why (the requester learns
        it at once instead of waiting out its timeout)."""
        try:
            return decode(msg.data, kind, (msg.headers or {}).get("Content-Type"))
        except DecodeError as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            if msg.reply:
                error = f"invalid {kind.__name__}: {exc}"[:4000]
                answer = ServiceError(
                    service=self.bus.service, error=error, context={"subject": msg.subject}
                )
                try:
                    await self.bus.nc.publish(msg.reply, encode(answer))
                except nats.errors.Error as failed:  # the requester's problem, not ours
                    log.debug("collective: could not answer %s: %s", msg.subject, failed)
            return None

    async def _answer(self, msg: Msg) -> None:
        if msg.reply:
            state = GroupState(
                sender=self.sender_id, generation=self.generation, host=self.host, port=self.port
            )
            await self.bus.nc.publish(msg.reply, encode(state))

    def _mark_dirty(self) -> None:
        self._dirty = True
        self._ops.put_nowait(_Op("wake"))

    async def _submit(self, op: _Op) -> str:
        if self._task is None or self._closed:
            raise WeightsError("the collective sender is not running (start() it; not closed)")
        op.done = asyncio.get_running_loop().create_future()
        self._ops.put_nowait(op)
        return await op.done

    # --- the broadcasting loop ----------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            if self._dirty:
                try:
                    await self._reform(healthy=True)
                except Exception:  # NATS gone, say; the next op or join tries again
                    log.exception("collective sender: forming a new generation failed")
                    self._dirty = True
            try:
                op = await asyncio.wait_for(self._ops.get(), self.heartbeat)
            except TimeoutError:
                op = _Op("heartbeat")
            if op.kind == "close":
                break
            try:
                result = await self._apply(op)
            except Exception as exc:  # one bad op must not stop the loop every send waits on
                log.exception("collective sender: %s of %s failed", op.kind, op.run_id or "-")
                if op.done is not None and not op.done.done():
                    op.done.set_exception(WeightsError(f"collective {op.kind} failed: {exc}"))
                continue
            if op.done is not None and not op.done.done():
                op.done.set_result(result)
        if self.members:
            await self._transmit_frame(_EndFrame(next_generation=0))
        await self._call(self._release)
        self.members = []
        while not self._ops.empty():
            op = self._ops.get_nowait()
            if op.done is not None and not op.done.done():
                op.done.set_exception(WeightsError("the collective sender closed"))

    async def _apply(self, op: _Op) -> str:
        ok = True
        if op.kind == "send":
            assert op.stream is not None
            stream = op.stream
            self._latest[op.run_id] = (op.step, stream)
            if self.members:
                ok = await self._transmit_stream(op.run_id, op.step, stream)
        elif op.kind == "forget":
            kept = self._latest.get(op.run_id)
            if kept is not None and kept[0] in op.steps:
                del self._latest[op.run_id]
            if self.members:
                ok = await self._transmit_frame(_ForgetFrame(run_id=op.run_id, steps=op.steps))
        elif op.kind == "heartbeat" and self.members:
            ok = await self._transmit_frame(None)
        if not ok:
            await self._reform(healthy=False)
        return location(self.host, self.port, self.generation, op.run_id, op.step)

    async def _reform(self, *, healthy: bool) -> None:
        """Form the next generation and bring it up to date (the newest stream of every run).

        ``healthy``: the current generation works, so it is ended with a frame; otherwise only
        the members that answer a ping are kept."""
        for _ in range(MAX_FORM_ATTEMPTS):
            self._dirty = False
            if healthy and self.members:
                healthy = await self._transmit_frame(_EndFrame(next_generation=self.generation + 1))
            # Destroying the group closes its connections: members still waiting in it fail
            # at once instead of at their timeout.
            await self._call(self._release)
            self.members = []
            if not healthy:
                await self._drop_unresponsive()
            if await self._form() and await self._catch_up():
                return
            healthy = False
        log.error(
            "collective: no generation could be formed in %d attempts; waiting for replicas to "
            "join again",
            MAX_FORM_ATTEMPTS,
        )
        await self._call(self._release)
        self.members = []
        self._wanted.clear()

    async def _form(self) -> bool:
        members = list(self._wanted)
        if not members:
            return True
        self.generation += 1
        generation = self.generation
        formed = GroupFormed(
            sender=self.sender_id,
            generation=generation,
            host=self.host,
            port=self.port,
            members=members,
        )
        await self.bus.nc.publish(self.subjects.formed, encode(formed))
        error = await self._call(self._build, generation, len(members) + 1)
        if error is None:
            self.members = members
            log.info("collective generation %d: %s", generation, ", ".join(members))
            return True
        missing = await self._call(self._missing, generation, members)
        log.warning(
            "collective generation %d could not be formed (%s); not there: %s",
            generation,
            error,
            ", ".join(missing) or "nobody (checking who answers)",
        )
        for member in missing:
            self._wanted.pop(member, None)
        return False

    async def _catch_up(self) -> bool:
        if not self.members:
            return True
        for run_id, (step, stream) in list(self._latest.items()):
            if not await self._transmit_stream(run_id, step, stream):
                return False
        return True

    async def _drop_unresponsive(self) -> None:
        members = list(self._wanted)
        answers = await asyncio.gather(*(self._answers(m) for m in members))
        for member, alive in zip(members, answers, strict=True):
            if not alive:
                log.warning("collective: %s does not answer; dropped from the group", member)
                self._wanted.pop(member, None)

    async def _answers(self, member: str) -> bool:
        try:
            await self.bus.request(
                self.subjects.alive(member),
                Ping(generation=self.generation),
                Pong,
                timeout=self.ping_timeout,
            )
        except (nats.errors.Error, TimeoutError, DecodeError):
            return False
        return True

    async def _transmit_frame(self, frame: _Frame | None) -> bool:
        return await self._transmit(functools.partial(_send_frame, frame=frame))

    async def _transmit_stream(self, run_id: str, step: int, stream: EncodedStream) -> bool:
        send = functools.partial(
            _send_stream, run_id=run_id, step=step, stream=stream, bucket_bytes=self.bucket_bytes
        )
        return await self._transmit(send)

    async def _transmit(self, collective: Callable[[Any], None]) -> bool:
        """Run ``collective`` on the current group; False (logged) when it failed."""
        error = await self._call(self._run_collective, collective)
        if error is not None:
            log.warning("collective generation %d failed: %s", self.generation, error)
        return error is None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        assert self._executor is not None
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # --- on the executor's thread -------------------------------------------------------------

    def _host_store(self) -> Any:
        store = torch.distributed.TCPStore(
            self.host,
            self.port,
            None,
            True,
            timedelta(seconds=self.timeout),
            wait_for_workers=False,
        )
        self.port = store.port
        return store

    def _drop_store(self) -> None:
        self._store = None

    def _build(self, generation: int, size: int) -> str | None:
        try:
            self._pg = _new_group(self._store, self.host, generation, 0, size, self.timeout)
        except RuntimeError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _missing(self, generation: int, members: list[str]) -> list[str]:
        return [m for m in members if not self._store.check([_ready_key(generation, m)])]

    def _run_collective(self, collective: Callable[[Any], None]) -> str | None:
        # The error is returned as text: an exception kept alive would keep the group (in its
        # traceback's frames) and with it the connections that tell members it is gone.
        try:
            collective(self._pg)
        except RuntimeError as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    def _release(self) -> None:
        if self._pg is not None:
            self._pg = None
            gc.collect()  # a cycle still holding the group would keep its sockets open
