"""A replica's end of the collective transport: :class:`CollectiveReceiver`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import CancelledError
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import msgspec
import nats.errors
import torch
from nats.aio.msg import Msg
from torch import Tensor

from schemas.codec import DecodeError, decode, encode
from schemas.events import WeightsReady
from schemas.subjects import validate_service_name
from services.bus import Bus
from services.weights.collective.protocol import (
    DEFAULT_GROUP,
    FETCH_TIMEOUT,
    JOIN_TIMEOUT,
    MAGIC,
    MAX_FRAME_BYTES,
    REJOIN_INTERVAL,
    TIMEOUT,
    GroupFormed,
    GroupState,
    JoinRequest,
    LeaveRequest,
    Pong,
    Subjects,
    _broadcast,
    _check_location,
    _EndFrame,
    _ForgetFrame,
    _frame_decoder,
    _move_buckets,
    _new_group,
    _ProtocolError,
    _ready_key,
    _StreamFrame,
)
from services.weights.errors import WeightsError
from services.weights.stream import StreamDecoder, check_fits

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Received:
    state: dict[str, Tensor] | None
    error: str | None
    digest: str
    size: int
    generation: int
    in_place: bool = False
    """Received into the run's destination (see :meth:`CollectiveReceiver.receive_into`)."""
    touched: bool = False
    """The error came after bytes had landed in the destination."""


class CollectiveReceiver:
    """Joins the group of the trainer on ``bus`` and keeps what it broadcasts, newest per run.

    ``replica_name`` names this replica in the member id. :meth:`receive_into` makes a run's
    transfers land in existing tensors (full weights, no second copy); ``keep_per_run`` steps of
    each run are kept for :meth:`fetch`. Transfers land when the trainer broadcasts them, not
    when they are fetched: a run's destination is written from the receiving thread as each of
    its broadcasts arrives.
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
        write_guard: AbstractContextManager[Any] | None = None,
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
        self.write_guard = write_guard
        """Held by the receiving thread while a transfer lands in a registered destination: a
        replica hands in the lock its generation holds, so no forward pass reads parameters that
        are half written (transfers land as they arrive, not when ``fetch`` is called)."""
        self.generation: int | None = None
        """The generation this replica takes part in now, or None (joining)."""
        self._lock = threading.Lock()
        self._announced = threading.Condition(self._lock)
        self._formed: GroupFormed | None = None
        self._received: dict[str, dict[int, _Received]] = {}
        self._destinations: dict[str, Mapping[str, Tensor]] = {}
        # Per run with a destination that was written: the step it holds intact, or None while
        # it holds part of a transfer (cut off, or refused by its digest).
        self._intact: dict[str, int | None] = {}
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
        generation = await self._until(lambda: self.generation, timeout)
        if generation is None:
            raise WeightsError(
                f"collective replica {self.member_id} joined no group within {timeout:g}s "
                f"(is a trainer with weight transport 'collective' up on this bus?)"
            )
        return generation

    async def _until(self, ready: Callable[[], _T | None], timeout: float) -> _T | None:
        """What ``ready()`` returns once it is not None, re-asked at every change the receiving
        thread notes; None after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            changed = self._changed  # before asking, so a change in between is not missed
            value = ready()
            remaining = deadline - loop.time()
            if value is not None or remaining <= 0:
                return value
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except TimeoutError:
                pass

    def receive_into(self, run_id: str, destination: Mapping[str, Tensor]) -> None:
        """Receive ``run_id``'s next transfers straight into ``destination``'s tensors."""
        with self._lock:
            if self._destinations.get(run_id) is not destination:
                self._intact.pop(run_id, None)
            self._destinations[run_id] = destination

    async def fetch(
        self, event: WeightsReady, destination: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]:
        """The tensors of the transfer ``event`` names, once they are here, size and digest checked.

        With ``destination`` the tensors end up in it: received in place when it was registered
        (here or with :meth:`receive_into`) before the transfer, copied otherwise; later
        transfers of the run are received in place. A WeightsError has ``touched`` set when the
        destination no longer holds what it held before this step's transfer: part of a
        transfer (cut off, or with a wrong digest), or a newer step."""
        where = f"weights for {event.run_id} step {event.step}"
        run_id, step = event.run_id, event.step
        _check_location(where, event)
        if destination is not None:
            self.receive_into(run_id, destination)

        def arrived() -> _Received | None:
            with self._lock:
                steps = self._received.get(run_id, {})
                got = steps.get(step)
                newest = max(steps, default=None)
            if got is None and newest is not None and newest > step:
                raise WeightsError(
                    f"{where}: step {newest} of the run arrived over the collective group "
                    "instead; this step is gone (superseded)",
                    touched=self._overwritten(run_id, step),
                )
            return got

        got = await self._until(arrived, self.fetch_timeout)
        if got is None:
            where_now = (
                f"member of generation {self.generation}"
                if self.generation is not None
                else "not in a group (still joining)"
            )
            raise WeightsError(
                f"{where}: not received over the collective group within "
                f"{self.fetch_timeout:g}s; replica {self.member_id} is {where_now}",
                touched=self._overwritten(run_id, step),
            )
        if got.error is not None:
            raise WeightsError(got.error, touched=got.touched)
        if got.size != event.size_bytes or got.digest != event.digest:
            raise WeightsError(
                f"{where}: the event announces {event.size_bytes} bytes with digest "
                f"{event.digest}, the trainer sent {got.size} bytes with digest {got.digest}",
                touched=got.in_place,
            )
        assert got.state is not None
        if got.in_place and self._overwritten(run_id, step):
            raise WeightsError(
                f"{where}: a newer transfer of the run has landed in the destination since; "
                "this step is gone (superseded)",
                touched=True,
            )
        if destination is None:
            return dict(got.state)
        if got.in_place:
            return _copy_into(where, got.state, destination)
        # Under the lock, so that a newer transfer does not start landing in the destination
        # while this step is copied there.
        with self._lock:
            if self._overwritten_locked(run_id, step):
                raise WeightsError(
                    f"{where}: a newer transfer of the run is landing in the destination; this "
                    "step is gone (superseded)",
                    touched=True,
                )
            copied = _copy_into(where, got.state, destination)
            # The destination holds this step now: keep it, not a second copy of the tensors.
            held = self._received.get(run_id, {})
            if held.get(step) is got:
                held[step] = dataclasses.replace(got, state=copied, in_place=True)
            self._intact[run_id] = step
        return copied

    def _overwritten(self, run_id: str, step: int) -> bool:
        """Whether the run's destination holds part of a transfer, or a step after ``step``."""
        with self._lock:
            return self._overwritten_locked(run_id, step)

    def _overwritten_locked(self, run_id: str, step: int) -> bool:
        if run_id not in self._intact:
            return False
        held = self._intact[run_id]
        return held is None or held > step

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
        touched = False
        try:
            decoder.feed_header(header.numpy().tobytes())
            views = decoder.targets()
            if [len(v) for v in views] != frame.segments:
                raise WeightsError(f"{where}: the header's tensor sizes differ from the frame's")
        except WeightsError as exc:
            # Refused before a byte of the data moved: nothing lands in the destination.
            error, views = str(exc), None
        in_place = views is not None and destination is not None
        if in_place:
            with self._lock:
                self._intact[frame.run_id] = None
        guard = self.write_guard if in_place and self.write_guard is not None else nullcontext()
        # Received even when it cannot be used: every rank must take part in every bucket.
        state = None
        with guard:
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
            if views is not None:
                try:
                    # under the guard too: tensors staged off the destination (on a GPU, or
                    # strided) are copied into it here
                    state = decoder.finish()
                except WeightsError as exc:
                    error, touched = str(exc), exc.touched
        with self._lock:
            if in_place and state is not None:
                self._intact[frame.run_id] = frame.step
            steps = self._received.setdefault(frame.run_id, {})
            steps[frame.step] = _Received(
                state, error, frame.digest, frame.size, generation, in_place, touched
            )
            for old in sorted(steps)[: -self.keep_per_run]:
                del steps[old]
        self._notify()

    def _set_generation(self, generation: int | None) -> None:
        self.generation = generation
        self._notify()


def _copy_into(
    where: str, state: Mapping[str, Tensor], destination: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """``state`` in ``destination``'s tensors: as it is when received there, else copied, once
    every tensor is known to fit (so a refusal leaves the destination as it was)."""
    check_fits(where, [(n, t.dtype, list(t.shape)) for n, t in state.items()], destination)
    result: dict[str, Tensor] = {}
    for name, tensor in state.items():
        target = destination[name]
        if target.data_ptr() != tensor.data_ptr():
            with torch.no_grad():
                target.copy_(tensor)
        result[name] = target
    return result
