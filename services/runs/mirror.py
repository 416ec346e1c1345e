"""The run mirror: the registry's run table as seen by the trainer and inference.

A mirror replays stream ``PLEXRL_RUNS`` from its first message with a
:class:`~services.bus.Follower` and then follows it. Arriving lifecycle events (RunDiscovered,
RunEvicted, RunForgotten) are only *buffered*; :meth:`RunMirror.synchronize_state` applies them,
at a point the caller chooses (the trainer: a step boundary), and runs the deletion and
creation hooks ``(idx, run_id)`` of the reference MultiRunManager on every rank.

Within one call every deletion hook runs before any creation hook, so a slot freed and reused
in the same call is reset before it is set up again. A run that appears and disappears within one call never existed at a step
boundary and gets no hook at all; a run evicted and later rediscovered (same id) gets a deletion
and then a creation.

A mirror shared by several ranks is handed ``broadcast``, which returns the main rank's value on
every rank (a collective: every rank calls it at the same point): the main rank picks the stream
sequence to apply up to, and every other rank first waits until its own buffer has reached that
sequence, so all ranks apply exactly the same events.

Lifecycle events of the default tenant's runs arrive on ``plexrl.runs.<kind>``, those of tenant
``t`` on ``plexrl.runs.<t>.<kind>``; the mirror decodes both and keeps each run's tenant
(:meth:`RunMirror.tenant_of`). An event whose ``tenant`` is not the one its subject names, or a
RunDiscovered whose config does not validate, is reported and skipped.
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from schemas import subjects as sj
from schemas.codec import DecodeError
from schemas.config import ConfigError, OrchConfig, orch_config_from_dict
from schemas.events import EvictRequested, RunDiscovered, RunEvicted, RunForgotten
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus, Follower, MessageMeta

log = logging.getLogger(__name__)

Lifecycle = RunDiscovered | RunEvicted | RunForgotten
_LIFECYCLE_KINDS = frozenset({"discovered", "evicted", "forgotten"})


def is_lifecycle_subject(subject: str) -> bool:
    """``plexrl.runs[.<tenant>].discovered|evicted|forgotten``."""
    tokens = subject.split(".")
    if len(tokens) not in (3, 4) or tokens[-1] not in _LIFECYCLE_KINDS:
        return False
    try:
        sj.tenant_of_subject(subject)
    except ValueError:
        return False
    return tokens[:2] == ["plexrl", "runs"]


@dataclass(frozen=True)
class RunInfo:
    """One run the mirror holds: its id, its index (adapter slot) and its config."""

    run_id: str
    idx: int
    config: OrchConfig
    config_digest: str
    tenant: str = DEFAULT_TENANT


@dataclass(frozen=True)
class _Slot:
    info: RunInfo
    incarnation: int  # tells a run rediscovered under the same id and index from its past self


class RunMirror:
    """Follows PLEXRL_RUNS; applies lifecycle events only in :meth:`synchronize_state`.

    ``broadcast`` describes the ranks sharing this mirror (see the module docstring); a single
    process needs none.
    """

    def __init__(
        self,
        bus: Bus,
        max_runs: int,
        *,
        service: str = "mirror",
        sync_timeout: float = 120.0,
        broadcast: Callable[[int], int] | None = None,
    ) -> None:
        self.bus = bus
        self.max_runs = max_runs
        self.service = service
        self.sync_timeout = sync_timeout
        self.broadcast = broadcast
        self._buffer: list[tuple[int, Lifecycle]] = []
        # The whole runs wildcard, not just the lifecycle subjects: then the last sequence
        # this mirror has seen is comparable with the stream's and identical on every rank.
        self._follower: Follower[Lifecycle] = Follower(
            bus,
            sj.RUNS_STREAM,
            sj.RUNS_WILDCARD,
            Lifecycle,
            self._on_event,
            decode_subjects=is_lifecycle_subject,
        )
        self._slots: dict[int, _Slot] = {}
        self._idx_by_id: dict[str, int] = {}
        self._incarnations = itertools.count(1)
        self._creation_hooks: list[Callable[[int, str], None]] = []
        self._deletion_hooks: list[Callable[[int, str], None]] = []

    # --- following the stream ----------------------------------------------------------------

    async def start(self) -> None:
        """Replay PLEXRL_RUNS from the start, then follow it. Events are buffered, not applied."""
        await self._follower.start()

    async def stop(self) -> None:
        await self._follower.stop()

    def _on_event(self, seq: int, event: Lifecycle, meta: MessageMeta) -> None:
        # The follower reports a DecodeError as invalid and skips the message.
        subject_tenant = sj.tenant_of_subject(meta.subject)
        if event.tenant != subject_tenant:
            raise DecodeError(
                f"{type(event).__name__} of {event.run_id} names tenant {event.tenant!r} but "
                f"arrived on {meta.subject} (tenant {subject_tenant!r})"
            )
        if isinstance(event, RunDiscovered):
            try:
                orch_config_from_dict(event.config)
            except ConfigError as exc:
                raise DecodeError(
                    f"RunDiscovered of {event.run_id} carries a config no run can use: {exc}"
                ) from None
        self._buffer.append((seq, event))

    async def wait_until_caught_up(self, timeout: float = 10.0) -> None:
        """Wait until the buffer holds everything the stream held when this was called."""
        await self._follower.wait_until_caught_up(timeout)

    @property
    def seen_seq(self) -> int:
        """The last stream sequence received (applied or not)."""
        return self._follower.seq

    # --- hooks -----------------------------------------------------------------------------

    def register_creation_hook(self, cb: Callable[[int, str], None]) -> None:
        """``cb(idx, run_id)`` for each run added, on every rank, in registration order."""
        self._creation_hooks.append(cb)

    def register_deletion_hook(self, cb: Callable[[int, str], None]) -> None:
        """``cb(idx, run_id)`` for each run removed, on every rank, in registration order."""
        self._deletion_hooks.append(cb)

    # --- applying --------------------------------------------------------------------------

    async def synchronize_state(self) -> int:
        """Apply every buffered event (up to the main rank's sequence); returns how many."""
        target = self._follower.seq
        if self.broadcast is not None:
            # It blocks the event loop briefly, in the caller's thread, so the caller's device
            # setting holds for NCCL.
            target = int(self.broadcast(target))
            await self._follower.wait_for_seq(target, self.sync_timeout)
        cut = 0
        while cut < len(self._buffer) and self._buffer[cut][0] <= target:
            cut += 1
        batch, self._buffer = self._buffer[:cut], self._buffer[cut:]
        deleted, created = self._apply(batch)
        self._idx_by_id = {slot.info.run_id: idx for idx, slot in self._slots.items()}
        for slot in deleted:
            for cb in self._deletion_hooks:
                cb(slot.info.idx, slot.info.run_id)
        for slot in created:
            for cb in self._creation_hooks:
                cb(slot.info.idx, slot.info.run_id)
        return len(batch)

    def _apply(self, batch: list[tuple[int, Lifecycle]]) -> tuple[list[_Slot], list[_Slot]]:
        """Update the state; return (removed, added) slots in event order, net of the batch."""
        before = {s.incarnation for s in self._slots.values()}
        deleted: list[_Slot] = []
        created: list[_Slot] = []

        def remove(idx: int) -> None:
            slot = self._slots.pop(idx)
            if slot.incarnation in before:
                deleted.append(slot)
            else:
                created.remove(slot)  # came and went within this batch

        for seq, event in batch:
            match event:
                case RunDiscovered(run_id=run_id, idx=idx):
                    if idx >= self.max_runs:
                        log.error(
                            "mirror: %s has index %d but this mirror holds %d slots; ignored "
                            "(start the registry with the same --max-runs)",
                            run_id,
                            idx,
                            self.max_runs,
                        )
                        continue
                    try:
                        config = orch_config_from_dict(event.config)
                    except ConfigError as exc:
                        log.error(
                            "mirror: %s (seq %d) has an unusable config: %s", run_id, seq, exc
                        )
                        continue
                    digest = config.digest()
                    held = self._slots.get(idx)
                    same = (
                        (held.info.run_id, held.info.config_digest, held.info.tenant)
                        if held
                        else None
                    )
                    if same == (run_id, digest, event.tenant):
                        continue  # the same announcement again
                    # The registry never does this; a mirror must still hold each run and
                    # index at most once.
                    if held is not None:
                        remove(idx)
                    for other, slot in list(self._slots.items()):
                        if slot.info.run_id == run_id:
                            remove(other)
                    info = RunInfo(run_id, idx, config, digest, event.tenant)
                    new = _Slot(info, next(self._incarnations))
                    self._slots[idx] = new
                    created.append(new)
                case RunEvicted(run_id=run_id, idx=idx) | RunForgotten(run_id=run_id, idx=idx):
                    held = self._slots.get(idx)
                    if held is not None and held.info.run_id == run_id:
                        remove(idx)
        return deleted, created

    # --- the applied state -------------------------------------------------------------------

    @property
    def runs(self) -> dict[int, RunInfo]:
        """The applied state: idx -> RunInfo."""
        return {idx: slot.info for idx, slot in sorted(self._slots.items())}

    def idx_of(self, run_id: str) -> int | None:
        return self._idx_by_id.get(run_id)

    def tenant_of(self, run_id: str) -> str | None:
        """The tenant of ``run_id`` in the applied state, None for a run this mirror lacks."""
        idx = self._idx_by_id.get(run_id)
        slot = self._slots.get(idx) if idx is not None else None
        return slot.info.tenant if slot else None

    def run_id_of(self, idx: int) -> str | None:
        slot = self._slots.get(idx)
        return slot.info.run_id if slot else None

    def config(self, idx: int) -> OrchConfig:
        slot = self._slots.get(idx)
        if slot is None:
            raise KeyError(f"no run holds index {idx} in this mirror")
        return slot.info.config

    async def evict_run(self, idx: int, reason: str) -> None:
        """Ask the registry to evict the run at ``idx`` (EvictRequested, requested_by=service)."""
        run_id = self.run_id_of(idx)
        if run_id is None:
            raise KeyError(f"cannot evict index {idx}: no run holds it in this mirror")
        await self.bus.publish(
            sj.EVICT,
            EvictRequested(run_id=run_id, reason=reason[:16000], requested_by=self.service),
            msg_id=f"{run_id}/evict/{uuid.uuid4().hex}",
        )
