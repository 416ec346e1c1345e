"""A replica's end of the collective transport: :class:`CollectiveReceiver`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from torch import Tensor

from schemas.events import WeightsReady
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.weights.collective.member import GroupMember
from services.weights.collective.protocol import (
    DEFAULT_GROUP,
    FETCH_TIMEOUT,
    JOIN_TIMEOUT,
    MAGIC,
    MAX_FRAME_BYTES,
    REJOIN_INTERVAL,
    TIMEOUT,
    _broadcast,
    _check_location,
    _EndFrame,
    _ForgetFrame,
    _frame_decoder,
    _move_buckets,
    _ProtocolError,
    _StreamFrame,
)
from services.weights.errors import WeightsError
from services.weights.header import check_fits
from services.weights.stream import StreamDecoder


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


class CollectiveReceiver(GroupMember):
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
        super().__init__(
            bus,
            replica_name,
            group=group,
            timeout=timeout,
            join_timeout=join_timeout,
            rejoin_interval=rejoin_interval,
        )
        self.fetch_timeout = fetch_timeout
        self.keep_per_run = keep_per_run
        self.write_guard = write_guard
        """Held by the receiving thread while a transfer lands in a registered destination: a
        replica hands in the lock its generation holds, so no forward pass reads parameters that
        are half written (transfers land as they arrive, not when ``fetch`` is called)."""
        self._received: dict[str, dict[int, _Received]] = {}
        self._destinations: dict[str, Mapping[str, Tensor]] = {}
        # Per run with a destination that was written: the step it holds intact, or None while
        # it holds part of a transfer (cut off, or refused by its digest).
        self._intact: dict[str, int | None] = {}

    def receive_into(self, run_id: str, destination: Mapping[str, Tensor]) -> None:
        """Receive ``run_id``'s next transfers straight into ``destination``'s tensors."""
        with self._lock:
            if self._destinations.get(run_id) is not destination:
                self._intact.pop(run_id, None)
            self._destinations[run_id] = destination

    async def fetch(
        self,
        event: WeightsReady,
        destination: Mapping[str, Tensor] | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
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

    # --- the receiving thread (GroupMember._take_part calls _receive) -----------------------------

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
