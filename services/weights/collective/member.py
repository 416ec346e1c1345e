"""A replica's membership in the collective group: :class:`GroupMember`, which
:class:`~services.weights.collective.receiver.CollectiveReceiver` extends with what it receives."""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import CancelledError
from datetime import timedelta
from typing import Any, TypeVar

import nats.errors
import torch
from nats.aio.msg import Msg

from schemas.codec import DecodeError, decode, encode
from schemas.collective import GroupFormed, GroupState, JoinRequest, LeaveRequest, Pong
from schemas.events import ServiceError
from schemas.subjects import collective_subjects, validate_service_name
from services.bus import Bus, flushed
from services.weights.collective.protocol import (
    DEFAULT_GROUP,
    JOIN_TIMEOUT,
    REJOIN_INTERVAL,
    TIMEOUT,
    _new_group,
    _ready_key,
)
from services.weights.errors import WeightsError

log = logging.getLogger(__name__)

_JOIN_ANSWER: Any = GroupState | ServiceError
"""what a join is answered with: the group's state, or why the request was refused"""

_T = TypeVar("_T")


class GroupMember:
    """Joins the group of the trainer on ``bus`` and takes part in each generation it is in.

    A background thread asks to join (again every ``rejoin_interval`` while no sender answers),
    waits for the generation that takes this replica in, builds its side of that generation's
    process group and hands it to :meth:`_receive` until the generation ends, then follows the
    sender to the next one. ``replica_name`` names this replica in the member id.
    """

    def __init__(
        self,
        bus: Bus,
        replica_name: str,
        *,
        group: str = DEFAULT_GROUP,
        timeout: float = TIMEOUT,
        join_timeout: float = JOIN_TIMEOUT,
        rejoin_interval: float = REJOIN_INTERVAL,
    ) -> None:
        self.bus = bus
        self.member_id = validate_service_name(f"{replica_name[:55]}-{uuid.uuid4().hex[:8]}")
        self.replica_name = replica_name
        self.subjects = collective_subjects(group)
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.rejoin_interval = rejoin_interval
        self.generation: int | None = None
        """The generation this replica takes part in now, or None (joining)."""
        self._lock = threading.Lock()
        self._announced = threading.Condition(self._lock)
        self._formed: GroupFormed | None = None
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
        await flushed(self.bus.nc)
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
            _JOIN_ANSWER,
            timeout=self.join_timeout,
        )
        try:
            state: GroupState | ServiceError = asyncio.run_coroutine_threadsafe(
                request, self._loop
            ).result(self.join_timeout + 1.0)
        except (nats.errors.Error, TimeoutError, DecodeError) as exc:
            log.debug("collective %s: join not answered (%s)", self.member_id, exc)
            self._stopping.wait(self.rejoin_interval)
            return None
        except (RuntimeError, CancelledError):  # the event loop is closing under us
            self._stopping.set()
            return None
        if isinstance(state, ServiceError):  # a sender of another version, say
            log.warning("collective %s: join refused: %s", self.member_id, state.error)
            self._stopping.wait(self.rejoin_interval)
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
        """Take part in generation ``generation`` on ``pg`` until it ends: the next generation
        (0: the sender closed), or None when this replica is stopping."""
        raise NotImplementedError

    def _set_generation(self, generation: int | None) -> None:
        self.generation = generation
        self._notify()
