"""The ``collective`` weight transport: the trainer broadcasts each adapter to every replica.

Roles. The trainer runs a :class:`CollectiveSender`, rank 0 of every group: it hosts a
``TCPStore`` on ``host:port`` and answers membership over NATS. Each inference replica runs a
:class:`CollectiveReceiver`: it joins over NATS, takes part in the group from a background
thread (collectives block) and keeps what arrives, the newest per run, until :meth:`fetch` asks.

Generations. A process group's members are fixed, so each change of membership forms a new
group, generation ``g``: ``ProcessGroupGloo(PrefixStore(f"gen{g}", store), rank, size)`` built
directly, never the default group (``init_process_group`` happens once per process, and a
trainer under torchrun owns it already). Gloo, also on GPU machines: streams are CPU memory
(:mod:`services.weights.stream`), and NCCL would need them on a device. The gloo device binds to
127.0.0.1 when the store's host is a loopback address, else to ``GLOO_SOCKET_IFNAME`` or the
address of the host name. Each member marks ``ready/gen<g>/<member>`` in the store before it
builds its side, so a generation that cannot be built drops the members that never came; after
:data:`MAX_FORM_ATTEMPTS` failures in a row the sender waits for replicas to join again.

Membership, over core NATS (``<group>`` is ``default`` unless both ends are told otherwise):

- ``plexrl.collective.<group>.join``, request/reply: :class:`JoinRequest` -> :class:`GroupState`.
  The sender adds the member and forms the next generation: every live member plus the joiner.
- ``plexrl.collective.<group>.leave``, request/reply: :class:`LeaveRequest` -> GroupState.
- ``plexrl.collective.<group>.formed``: :class:`GroupFormed`, the members of generation ``g`` in
  rank order (rank ``i + 1`` is ``members[i]``), published before the sender builds it.
- ``plexrl.collective.<group>.alive.<member>``, request/reply: :class:`Ping` -> :class:`Pong`.
  After a failed collective the sender keeps the members that answer and drops the others.

Every new generation is brought up to date first: the sender re-sends the newest stream of
every run, so a replica that joins late has the current weights of all runs.

Frames. Every collective comes from the sender's one broadcasting thread, in order, so all ranks
call the same broadcasts with the same sizes. A frame starts with ``int64[2]`` ``[MAGIC, n]``:
``n == 0`` is a heartbeat (sent after :data:`HEARTBEAT` idle seconds), otherwise ``uint8[n]``
follows, a JSON frame: a stream (run, step, size, digest, header and segment lengths, bucket
size), then the stream's header (with its 8-byte length prefix), then its data in buckets (see
:func:`bucket_plan`); a ``forget``; or ``end`` (this generation is over: a new one follows, or
the sender is closing). Receivers need no other channel to know what comes next.

Timeouts, so that nothing waits forever:

- ``timeout`` (:data:`TIMEOUT`, both ends): building a generation and each broadcast. A sender
  whose broadcast fails or times out forms a new generation of the members that still answer a
  ping within ``ping_timeout`` (:data:`PING_TIMEOUT`); a SIGKILLed replica fails the next
  broadcast at once (the connection closes). A receiver that hears nothing, not even a
  heartbeat, for ``timeout`` gives the generation up.
- ``join_timeout`` (:data:`JOIN_TIMEOUT`): each join or leave request, and how long a receiver
  whose generation failed waits for the sender to announce the next one before it asks to join
  again; with no sender answering, it asks every ``rejoin_interval`` (:data:`REJOIN_INTERVAL`)
  until closed, so replicas find a restarted trainer by themselves.
- ``fetch_timeout`` (:data:`FETCH_TIMEOUT`): how long :meth:`CollectiveReceiver.fetch` waits for
  the announced transfer; a run whose newer step has arrived instead fails at once.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import ipaddress
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import msgspec
import nats.errors
import torch
from nats.aio.msg import Msg
from torch import Tensor

from schemas.codec import DecodeError, decode, encode
from schemas.events import WeightsReady
from schemas.run_id import validate_run_id
from schemas.subjects import validate_service_name
from services.bus import Bus
from services.weights.errors import WeightsError
from services.weights.stream import EncodedStream, StreamDecoder, byte_view

log = logging.getLogger(__name__)

DEFAULT_GROUP = "default"
SUBJECT_PREFIX = "plexrl.collective"
TIMEOUT = 30.0
"""Seconds for building a generation and for each broadcast, on both ends."""
HEARTBEAT = 2.0
"""Idle seconds after which the sender broadcasts a heartbeat (well under ``TIMEOUT``)."""
PING_TIMEOUT = 2.0
"""Seconds a member has to answer the sender's liveness check after a failed collective."""
JOIN_TIMEOUT = 5.0
"""Seconds to wait for the sender's answer to a join or leave request."""
REJOIN_INTERVAL = 1.0
"""Seconds between two join requests while no sender answers."""
FETCH_TIMEOUT = 60.0
"""Seconds :meth:`CollectiveReceiver.fetch` waits for the transfer an event names."""
MAX_FORM_ATTEMPTS = 3
"""Generations tried in a row after failures before the sender stops and waits for new joins."""
MAGIC = 0x504C5843  # "PLXC"
COALESCE_BELOW = 1 << 20
"""Pieces smaller than this (or than half a bucket) share buckets, copied through a buffer."""
MAX_FRAME_BYTES = 64 << 20


# --- membership messages (core NATS, JSON) ----------------------------------------------------


class JoinRequest(msgspec.Struct, frozen=True, kw_only=True, tag="collective_join"):
    """A replica asks to receive weights. Producer: CollectiveReceiver. Consumer: the sender."""

    member: str
    replica: str


class LeaveRequest(msgspec.Struct, frozen=True, kw_only=True, tag="collective_leave"):
    """A replica that closes. Producer: CollectiveReceiver. Consumer: CollectiveSender."""

    member: str


class GroupState(msgspec.Struct, frozen=True, kw_only=True, tag="collective_state"):
    """The answer to a join or leave: which sender, its current generation, its store's address.

    Producer: CollectiveSender. Consumer: the CollectiveReceiver that asked."""

    sender: str
    generation: int
    host: str
    port: int


class GroupFormed(msgspec.Struct, frozen=True, kw_only=True, tag="collective_formed"):
    """Generation ``generation`` is being built: ``members[i]`` takes rank ``i + 1``.

    Producer: CollectiveSender. Consumers: every CollectiveReceiver of the group."""

    sender: str
    generation: int
    host: str
    port: int
    members: list[str]


class Ping(msgspec.Struct, frozen=True, kw_only=True, tag="collective_ping"):
    """Are you still there? Producer: CollectiveSender. Consumer: one CollectiveReceiver."""

    generation: int


class Pong(msgspec.Struct, frozen=True, kw_only=True, tag="collective_pong"):
    """Yes. Producer: CollectiveReceiver. Consumer: CollectiveSender."""

    member: str


@dataclass(frozen=True)
class Subjects:
    """The subjects of one collective group."""

    join: str
    leave: str
    formed: str
    alive_prefix: str

    @classmethod
    def of(cls, group: str) -> Subjects:
        base = f"{SUBJECT_PREFIX}.{validate_service_name(group)}"
        return cls(f"{base}.join", f"{base}.leave", f"{base}.formed", f"{base}.alive.")

    def alive(self, member: str) -> str:
        return self.alive_prefix + validate_service_name(member)


# --- frames (inside a generation) -------------------------------------------------------------


class _StreamFrame(msgspec.Struct, frozen=True, kw_only=True, tag="stream"):
    run_id: str
    step: int
    size: int
    digest: str
    header_bytes: int
    segments: list[int]
    bucket_bytes: int


class _ForgetFrame(msgspec.Struct, frozen=True, kw_only=True, tag="forget"):
    run_id: str
    steps: list[int]


class _EndFrame(msgspec.Struct, frozen=True, kw_only=True, tag="end"):
    next_generation: int
    """The generation that follows, or 0 when the sender is closing."""


_Frame = _StreamFrame | _ForgetFrame | _EndFrame
_frame_decoder = msgspec.json.Decoder(_Frame)


class _ProtocolError(RuntimeError):
    """The ranks are out of step; the generation cannot go on."""


def bucket_plan(lengths: Sequence[int], bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
    """How a stream's data travels: buckets of ``(segment, start, stop)`` pieces, in order.

    Each segment (tensor) is cut into pieces of at most ``bucket_bytes``. A piece of at least
    ``min(COALESCE_BELOW, bucket_bytes // 2)`` bytes is a bucket of its own, broadcast as a view
    of the tensor's memory on both ends (no copy); smaller pieces share buckets of at most
    ``bucket_bytes``, copied through a buffer. Sender and receiver compute the same plan from the
    same lengths, so bucket ``k`` has the same size on every rank.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    alone = max(1, min(COALESCE_BELOW, bucket_bytes // 2))
    plan: list[list[tuple[int, int, int]]] = []
    shared: list[tuple[int, int, int]] = []
    filled = 0
    for i, length in enumerate(lengths):
        for start in range(0, length, bucket_bytes):
            stop = min(length, start + bucket_bytes)
            if stop - start >= alone:
                plan.append([(i, start, stop)])
                continue
            if filled + stop - start > bucket_bytes:
                plan.append(shared)
                shared, filled = [], 0
            shared.append((i, start, stop))
            filled += stop - start
    if shared:
        plan.append(shared)
    return plan


def _broadcast(pg: Any, tensor: Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    pg.broadcast([tensor], options).wait()


def _send_frame(pg: Any, frame: _Frame | None) -> None:
    payload = b"" if frame is None else msgspec.json.encode(frame)
    _broadcast(pg, torch.tensor([MAGIC, len(payload)], dtype=torch.int64))
    if payload:
        _broadcast(pg, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def _move_buckets(
    pg: Any,
    lengths: Sequence[int],
    bucket_bytes: int,
    views: Sequence[memoryview] | None,
    *,
    sending: bool,
    landed: Callable[[int], None] | None = None,
) -> None:
    """Broadcast (``sending``) or receive the data of a stream, bucket by bucket.

    ``views`` are the segments' bytes; a receiver passes None to take part without keeping
    anything (a stream it could not decode must still be received, to stay in step).
    ``landed`` hears the bytes in place so far after each bucket (buckets go in stream order)."""
    plan = bucket_plan(lengths, bucket_bytes)
    shared = max(
        (sum(b - a for _, a, b in bucket) for bucket in plan if len(bucket) > 1), default=0
    )
    buffer = torch.empty(max(shared, bucket_bytes if views is None else 0), dtype=torch.uint8)
    staging = byte_view(buffer)
    progress = _Landed(lengths, plan, landed) if landed is not None else None
    for k, bucket in enumerate(plan):
        nbytes = sum(stop - start for _, start, stop in bucket)
        if views is not None and len(bucket) == 1:
            i, start, stop = bucket[0]
            _broadcast(pg, torch.frombuffer(views[i][start:stop], dtype=torch.uint8))
            if progress is not None:
                progress.bucket_done(k)
            continue
        if views is None:
            _broadcast(pg, buffer[:nbytes])
            continue
        offset = 0
        if sending:
            for i, start, stop in bucket:
                staging[offset : offset + stop - start] = views[i][start:stop]
                offset += stop - start
        _broadcast(pg, buffer[:nbytes])
        if not sending:
            for i, start, stop in bucket:
                views[i][start:stop] = staging[offset : offset + stop - start]
                offset += stop - start
            if progress is not None:
                progress.bucket_done(k)


class _Landed:
    """Turns finished buckets into the stream-order prefix of bytes in place.

    Small pieces wait in a shared bucket that travels after the large pieces behind them, so
    buckets finish out of stream order; ``landed`` hears how far the data is complete from the
    start, which is what a digest computed while receiving needs."""

    def __init__(
        self,
        lengths: Sequence[int],
        plan: Sequence[Sequence[tuple[int, int, int]]],
        landed: Callable[[int], None],
    ) -> None:
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        # (global start, global stop, bucket) of every piece, in stream order
        self._pieces = sorted(
            (starts[i] + a, starts[i] + b, k) for k, bucket in enumerate(plan) for i, a, b in bucket
        )
        self._done: set[int] = set()
        self._next = 0
        self._landed = landed

    def bucket_done(self, k: int) -> None:
        self._done.add(k)
        advanced = False
        while self._next < len(self._pieces) and self._pieces[self._next][2] in self._done:
            self._next += 1
            advanced = True
        if advanced:
            self._landed(self._pieces[self._next - 1][1])


def _send_stream(pg: Any, run_id: str, step: int, stream: EncodedStream, bucket_bytes: int) -> None:
    views = stream.data_segments()
    lengths = [len(v) for v in views]
    frame = _StreamFrame(
        run_id=run_id,
        step=step,
        size=stream.size,
        digest=stream.digest,
        header_bytes=len(stream.header),
        segments=lengths,
        bucket_bytes=bucket_bytes,
    )
    _send_frame(pg, frame)
    _broadcast(pg, torch.frombuffer(bytearray(stream.header), dtype=torch.uint8))
    _move_buckets(pg, lengths, bucket_bytes, views, sending=True)


def _gloo_device(host: str) -> Any:
    from torch.distributed import ProcessGroupGloo

    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return ProcessGroupGloo.create_device(interface=interface)
    if _is_loopback(host):
        return ProcessGroupGloo.create_device(hostname="127.0.0.1")
    return ProcessGroupGloo.create_default_device()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _new_group(store: Any, host: str, generation: int, rank: int, size: int, timeout: float) -> Any:
    """Generation ``generation``'s gloo group; blocks until every rank connected (``timeout``)."""
    from torch.distributed import PrefixStore, ProcessGroupGloo

    # The options form is the one that takes a device; torch's own group helper uses it too.
    options = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = timedelta(seconds=timeout)
    options._devices = [_gloo_device(host)]
    return ProcessGroupGloo(PrefixStore(f"gen{generation}", store), rank, size, options)


def _ready_key(generation: int, member: str) -> str:
    return f"ready/gen{generation}/{member}"


def location(host: str, port: int, generation: int, run_id: str, step: int) -> str:
    """``collective://<host>:<port>/gen<g>/<run_id>/step_<n>``: group, generation, transfer."""
    return f"collective://{host}:{port}/gen{generation}/{run_id}/step_{step}"


# --- the trainer's end ------------------------------------------------------------------------


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
        self.subjects = Subjects.of(group)
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
        await self.bus.nc.flush()
        self._task = asyncio.create_task(self._serve(), name="collective-sender")
        log.info("collective sender %s: store on %s:%d", self.sender_id, self.host, self.port)

    async def send(self, run_id: str, step: int, stream: EncodedStream) -> str:
        """Broadcast ``stream`` to the current generation, keep it for later ones, say where.

        Returns once every member has it (or, when a member failed, once a new generation has
        the newest stream of every run). With no members it is only kept."""
        validate_run_id(run_id)
        op = _Op("send", run_id=run_id, step=step, stream=stream)
        return await self._submit(op)

    async def forget(self, run_id: str, steps: Collection[int]) -> None:
        """Drop those steps here and on every member (the newest kept is dropped only if named)."""
        await self._submit(_Op("forget", run_id=run_id, steps=sorted(steps)))

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
        try:
            req: JoinRequest = decode(
                msg.data, JoinRequest, (msg.headers or {}).get("Content-Type")
            )
            validate_service_name(req.member)
        except (DecodeError, ValueError) as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            return
        log.info("collective: %s (%s) asks to join", req.member, req.replica)
        self._wanted[req.member] = req.replica
        self._mark_dirty()
        await self._answer(msg)

    async def _on_leave(self, msg: Msg) -> None:
        try:
            req: LeaveRequest = decode(
                msg.data, LeaveRequest, (msg.headers or {}).get("Content-Type")
            )
        except DecodeError as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            return
        if self._wanted.pop(req.member, None) is not None or req.member in self.members:
            log.info("collective: %s leaves", req.member)
            self._mark_dirty()
        await self._answer(msg)

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


# --- a replica's end --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Received:
    state: dict[str, Tensor] | None
    error: str | None
    digest: str
    size: int
    generation: int


class CollectiveReceiver:
    """Joins the group of the trainer on ``bus`` and keeps what it broadcasts, newest per run.

    ``replica_name`` names this replica in the member id. :meth:`receive_into` makes a run's
    transfers land in existing tensors (full weights, no second copy); ``keep_per_run`` steps of
    each run are kept for :meth:`fetch`.
    """

    name = "collective"

    def __init__(
        self,
        bus: Bus,
        replica_name: str,
        *,
        group: str = DEFAULT_GROUP,
        timeout: float = TIMEOUT,
        fetch_timeout: float = FETCH_TIMEOUT,
        join_timeout: float = JOIN_TIMEOUT,
        rejoin_interval: float = REJOIN_INTERVAL,
        keep_per_run: int = 2,
    ) -> None:
        if keep_per_run < 1:
            raise ValueError(f"keep_per_run must be at least 1, got {keep_per_run}")
        self.bus = bus
        self.member_id = validate_service_name(f"{replica_name[:55]}-{uuid.uuid4().hex[:8]}")
        self.replica_name = replica_name
        self.subjects = Subjects.of(group)
        self.timeout = timeout
        self.fetch_timeout = fetch_timeout
        self.join_timeout = join_timeout
        self.rejoin_interval = rejoin_interval
        self.keep_per_run = keep_per_run
        self.generation: int | None = None
        """The generation this replica takes part in now, or None (joining)."""
        self._lock = threading.Lock()
        self._announced = threading.Condition(self._lock)
        self._formed: GroupFormed | None = None
        self._received: dict[str, dict[int, _Received]] = {}
        self._destinations: dict[str, Mapping[str, Tensor]] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed = asyncio.Event()
        self._subs: list[Any] = []
        self._asked = False

    async def start(self) -> None:
        """Listen for announcements, then join from the background (a trainer may come later)."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._subs = [
            await self.bus.nc.subscribe(self.subjects.formed, cb=self._on_formed),
            await self.bus.nc.subscribe(self.subjects.alive(self.member_id), cb=self._on_ping),
        ]
        await self.bus.nc.flush()
        self._thread = threading.Thread(
            target=self._run, name=f"collective-{self.member_id}", daemon=True
        )
        self._thread.start()

    async def joined(self, timeout: float = TIMEOUT) -> int:
        """Wait until this replica takes part in a generation; which one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.generation is None:
            changed = self._changed
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise WeightsError(
                    f"collective replica {self.member_id} joined no group within {timeout:g}s "
                    f"(is a trainer with weight transport 'collective' up on this bus?)"
                )
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass
        return self.generation

    def receive_into(self, run_id: str, destination: Mapping[str, Tensor]) -> None:
        """Receive ``run_id``'s next transfers straight into ``destination``'s tensors."""
        with self._lock:
            self._destinations[run_id] = destination

    async def fetch(
        self, event: WeightsReady, destination: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The tensors of the transfer ``event`` names, once they are here, size and digest checked.

        With ``destination`` the tensors end up in it: received in place when it was registered
        (here or with :meth:`receive_into`) before the transfer, copied otherwise; later
        transfers of the run are received in place."""
        where = f"weights for {event.run_id} step {event.step}"
        _check_location(where, event)
        if destination is not None:
            self.receive_into(event.run_id, destination)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.fetch_timeout
        while True:
            changed = self._changed
            with self._lock:
                steps = self._received.get(event.run_id, {})
                got = steps.get(event.step)
                newest = max(steps, default=None)
            if got is not None:
                break
            if newest is not None and newest > event.step:
                raise WeightsError(
                    f"{where}: step {newest} of the run arrived over the collective group "
                    "instead; this step is gone (superseded)"
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                where_now = (
                    f"member of generation {self.generation}"
                    if self.generation is not None
                    else "not in a group (still joining)"
                )
                raise WeightsError(
                    f"{where}: not received over the collective group within "
                    f"{self.fetch_timeout:g}s; replica {self.member_id} is {where_now}"
                )
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass
        if got.error is not None:
            raise WeightsError(got.error)
        if got.size != event.size_bytes or got.digest != event.digest:
            raise WeightsError(
                f"{where}: the event announces {event.size_bytes} bytes with digest "
                f"{event.digest}, the trainer sent {got.size} bytes with digest {got.digest}"
            )
        assert got.state is not None
        if destination is None:
            return dict(got.state)
        return _copy_into(where, got.state, destination)

    async def close(self) -> None:
        """Leave the group and stop the thread (bounded by ``timeout``)."""
        self._stopping.set()
        with self._announced:
            self._announced.notify_all()
        # A sender that took the join request waits for this member in its next generation
        # until told otherwise.
        if self._asked and not self.bus.nc.is_closed:
            try:
                await self.bus.request(
                    self.subjects.leave,
                    LeaveRequest(member=self.member_id),
                    GroupState,
                    timeout=self.join_timeout,
                )
            except (nats.errors.Error, TimeoutError, DecodeError) as exc:
                log.info("collective: leave request not answered (%s)", exc)
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join, self.timeout + self.join_timeout)
            if thread.is_alive():
                log.warning("collective receiver %s: thread still busy; left behind", thread.name)
        for sub in self._subs:
            if not self.bus.nc.is_closed:
                await sub.unsubscribe()
        self._subs = []

    # --- NATS callbacks (event loop) ----------------------------------------------------------

    async def _on_formed(self, msg: Msg) -> None:
        try:
            formed: GroupFormed = decode(msg.data, GroupFormed)
        except DecodeError as exc:
            await self.bus.report_invalid(msg.subject, str(exc), msg.data)
            return
        with self._announced:
            current = self._formed
            if (
                current is None
                or current.sender != formed.sender
                or (formed.generation > current.generation)
            ):
                self._formed = formed
                self._announced.notify_all()

    async def _on_ping(self, msg: Msg) -> None:
        thread = self._thread
        if msg.reply and thread is not None and thread.is_alive() and not self._stopping.is_set():
            await self.bus.nc.publish(msg.reply, encode(Pong(member=self.member_id)))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        """From the thread: something changed that waiters on the event loop look at."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop closed in between
                pass

    # --- the receiving thread -----------------------------------------------------------------

    def _run(self) -> None:
        formed: GroupFormed | None = None
        try:
            while not self._stopping.is_set():
                if formed is None:
                    formed = self._join()
                    continue
                next_generation = self._take_part(formed)
                if next_generation:
                    formed = self._wait_formed(formed.sender, next_generation - 1, self.timeout)
                elif next_generation is None:  # lost: a new generation may be on its way
                    formed = self._wait_formed(formed.sender, formed.generation, self.join_timeout)
                else:  # the sender closed
                    formed = None
        except Exception:
            log.exception("collective receiver %s stopped", self.member_id)
        finally:
            self._set_generation(None)

    def _join(self) -> GroupFormed | None:
        """Ask to join until a sender answers; the generation that takes this replica in."""
        assert self._loop is not None
        self._asked = True  # the sender may take the request even if its answer is lost
        request = self.bus.request(
            self.subjects.join,
            JoinRequest(member=self.member_id, replica=self.replica_name),
            GroupState,
            timeout=self.join_timeout,
        )
        try:
            state = asyncio.run_coroutine_threadsafe(request, self._loop).result(
                self.join_timeout + 1.0
            )
        except (nats.errors.Error, TimeoutError, DecodeError) as exc:
            log.debug("collective %s: join not answered (%s)", self.member_id, exc)
            self._stopping.wait(self.rejoin_interval)
            return None
        except (RuntimeError, CancelledError):  # the event loop is closing under us
            self._stopping.set()
            return None
        return self._wait_formed(state.sender, state.generation, self.timeout)

    def _wait_formed(self, sender: str, after: int, timeout: float) -> GroupFormed | None:
        """The next generation ``sender`` announces after ``after``, if this replica is in it.

        None when it is not (the sender dropped it: ask again), when none comes within
        ``timeout``, or when stopping."""

        def newer() -> bool:
            f = self._formed
            return f is not None and f.sender == sender and f.generation > after

        with self._announced:
            self._announced.wait_for(lambda: newer() or self._stopping.is_set(), timeout)
            formed = self._formed
            if self._stopping.is_set() or not newer() or formed is None:
                return None
            return formed if self.member_id in formed.members else None

    def _take_part(self, formed: GroupFormed) -> int | None:
        """Receive in generation ``formed`` until it ends: the next generation (0: the sender
        closed), or None when the group failed or this replica is stopping."""
        generation = formed.generation
        rank = formed.members.index(self.member_id) + 1
        try:
            store = torch.distributed.TCPStore(
                formed.host, formed.port, None, False, timedelta(seconds=self.timeout)
            )
            store.set(_ready_key(generation, self.member_id), "1")
            pg = _new_group(
                store, formed.host, generation, rank, len(formed.members) + 1, self.timeout
            )
        except (RuntimeError, OSError) as exc:
            log.warning("collective generation %d: could not take part: %s", generation, exc)
            return None
        log.info("collective %s: rank %d of generation %d", self.member_id, rank, generation)
        self._set_generation(generation)
        try:
            return self._receive(pg, generation)
        except RuntimeError as exc:
            log.warning("collective generation %d lost: %s", generation, exc)
            return None
        finally:
            self._set_generation(None)

    def _receive(self, pg: Any, generation: int) -> int | None:
        control = torch.zeros(2, dtype=torch.int64)
        while True:
            _broadcast(pg, control)
            magic, length = (int(v) for v in control.tolist())
            if magic != MAGIC or not 0 <= length <= MAX_FRAME_BYTES:
                raise _ProtocolError(f"not a frame: magic {magic:#x}, length {length}")
            if length == 0:  # a heartbeat
                if self._stopping.is_set():
                    return None
                continue
            payload = torch.empty(length, dtype=torch.uint8)
            _broadcast(pg, payload)
            try:
                frame = _frame_decoder.decode(payload.numpy().tobytes())
            except msgspec.DecodeError as exc:
                raise _ProtocolError(f"a frame that cannot be read: {exc}") from None
            match frame:
                case _StreamFrame():
                    self._receive_stream(pg, frame, generation)
                case _ForgetFrame(run_id=run_id, steps=steps):
                    with self._lock:
                        held = self._received.get(run_id, {})
                        for step in steps:
                            held.pop(step, None)
                case _EndFrame(next_generation=next_generation):
                    return next_generation

    def _receive_stream(self, pg: Any, frame: _StreamFrame, generation: int) -> None:
        if (
            not 8 <= frame.header_bytes <= frame.size - sum(frame.segments)
            or min(frame.segments, default=0) < 0
        ):
            raise _ProtocolError(f"a stream frame whose sizes do not add up: {frame}")
        header = torch.empty(frame.header_bytes, dtype=torch.uint8)
        _broadcast(pg, header)
        where = f"weights for {frame.run_id} step {frame.step}"
        with self._lock:
            destination = self._destinations.get(frame.run_id)
        decoder = StreamDecoder(where, frame.size, frame.digest, destination)
        views: list[memoryview] | None = None
        error: str | None = None
        try:
            decoder.feed_header(header.numpy().tobytes())
            views = decoder.targets()
            if [len(v) for v in views] != frame.segments:
                raise WeightsError(f"{where}: the header's tensor sizes differ from the frame's")
        except WeightsError as exc:
            error, views = str(exc), None
        # Received even when it cannot be used: every rank must take part in every bucket.
        try:
            _move_buckets(
                pg,
                frame.segments,
                frame.bucket_bytes,
                views,
                sending=False,
                landed=decoder.landed if views is not None else None,
            )
        except BaseException:
            decoder.abandon()
            raise
        state = None
        if views is not None:
            try:
                state = decoder.finish()
            except WeightsError as exc:
                error = str(exc)
        with self._lock:
            steps = self._received.setdefault(frame.run_id, {})
            steps[frame.step] = _Received(state, error, frame.digest, frame.size, generation)
            for old in sorted(steps)[: -self.keep_per_run]:
                del steps[old]
        self._notify()

    def _set_generation(self, generation: int | None) -> None:
        self.generation = generation
        self._notify()


def _check_location(where: str, event: WeightsReady) -> None:
    parts = urlsplit(event.location)
    path = parts.path.strip("/").split("/")
    if (
        parts.scheme != "collective"
        or len(path) != 3
        or path[1] != event.run_id
        or path[2] != f"step_{event.step}"
    ):
        raise WeightsError(
            f"{where}: location {event.location!r} is not this run's transfer "
            f"(collective://<host>:<port>/gen<g>/{event.run_id}/step_{event.step})"
        )


def _copy_into(
    where: str, state: Mapping[str, Tensor], destination: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """``state`` in ``destination``'s tensors: as it is when received there, else copied."""
    result: dict[str, Tensor] = {}
    for name, tensor in state.items():
        target = destination.get(name)
        if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
            raise WeightsError(
                f"{where}: tensor {name!r} ({tensor.dtype} {list(tensor.shape)}) does not fit "
                "the destination"
            )
        if target.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                target.copy_(tensor)
        result[name] = target
    return result
