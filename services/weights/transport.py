"""One interface for every weight transport, and the table that names them.

A transport has two ends. Its :class:`WeightSender` runs in the trainer: it stores or offers a
run's :class:`~services.weights.stream.EncodedStream` at a step and says where (the WeightsReady
``location``), lists what an earlier trainer left, and removes old versions. Its
:class:`WeightFetcher` runs on each inference replica: it receives what a WeightsReady announces
through a :class:`~services.weights.stream.StreamDecoder`, whose ``finish`` checks the size and
the digest (the one place they are checked).

:data:`TRANSPORTS` maps each name to its module (imported when used, so ``ucxx`` and
torch.distributed load only where chosen). A module provides ``sender(bus, output_dir,
keep_last, options)``, ``fetcher(bus, output_dir)`` (None when a replica must set one up itself,
as a collective replica joins its group at start-up) and, if it may not run everywhere,
``unavailable()``, why it cannot run here or None. The publisher and the loader pick a transport from this table and nothing else.

Every call names the run's ``tenant``: the object store keeps each tenant's weights in a store
of its own (``plexrl-weights-<tenant>``); the other transports keep no per-tenant place and
ignore it.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from schemas.events import WeightsReady
from schemas.tenant import DEFAULT_TENANT

if TYPE_CHECKING:
    from services.bus import Bus
    from services.weights.stream import EncodedStream

TRANSPORTS: dict[str, str] = {
    "object_store": "services.weights.object_store",
    "filesystem": "services.weights.filesystem",
    "ucx": "services.weights.ucx",
    "collective": "services.weights.collective",
}

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderOptions:
    """Where the trainer end of a direct transport listens: the address replicas reach it on
    (written into each location) and its port, 0 for a free one."""

    ucx_host: str = "127.0.0.1"
    ucx_port: int = 0
    collective_host: str = "127.0.0.1"
    collective_port: int = 0
    collective_bucket_bytes: int = 32 << 20


class WeightSender(Protocol):
    """The trainer's end: makes a run's weights at a step available and says where."""

    name: str
    in_memory: bool
    """Whether versions are held in the trainer's memory (of a whole model, keep only one)."""

    async def start(self) -> None:
        """Listen, join a group: whatever must be up before the first :meth:`send`."""
        ...

    async def send(
        self,
        run_id: str,
        step: int,
        stream: EncodedStream,
        adapter_config: Any = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> str:
        """Offer ``stream`` as ``run_id``'s weights at ``step``; the WeightsReady location.
        ``adapter_config`` is the PEFT ``adapter_config.json`` of an adapter (None: full
        weights), for a transport that writes a directory PEFT and vLLM load."""
        ...

    async def stored(self, run_id: str, *, tenant: str = DEFAULT_TENANT) -> set[int]:
        """The steps of ``run_id`` held now, e.g. left by an earlier trainer."""
        ...

    async def forget(
        self, run_id: str, steps: Collection[int], *, tenant: str = DEFAULT_TENANT
    ) -> set[int]:
        """Drop those steps (garbage collection of old versions); the ones now gone."""
        ...

    async def close(self) -> None: ...


class WeightFetcher(Protocol):
    """An inference replica's end: the tensors a WeightsReady announces, size and digest checked.

    Raises :class:`~services.weights.errors.WeightsError` naming the run and step for anything
    that goes wrong. With ``destination``, tensors are received in place into those tensors.
    """

    async def fetch(
        self,
        event: WeightsReady,
        destination: Mapping[str, Tensor] | None = None,
        *,
        tenant: str = DEFAULT_TENANT,
    ) -> dict[str, Tensor]: ...

    async def close(self) -> None: ...


async def forget_each(
    run_id: str,
    steps: Collection[int],
    remove: Callable[[int], Awaitable[object]],
    errors: tuple[type[BaseException], ...],
) -> set[int]:
    """``remove`` each step's weights; the steps removed (a failure is logged, not raised)."""
    removed = set()
    for step in steps:
        try:
            await remove(step)
        except errors as exc:
            log.warning("%s: could not remove weights of step %d: %s", run_id, step, exc)
            continue
        removed.add(step)
    return removed


def module(transport: str) -> ModuleType:
    """The module of ``transport``; ValueError for a name not in :data:`TRANSPORTS`."""
    if transport not in TRANSPORTS:
        raise ValueError(
            f"weight transport {transport!r} is not known to this build: use "
            + ", ".join(repr(t) for t in TRANSPORTS)
        )
    return importlib.import_module(TRANSPORTS[transport])


def make_sender(
    transport: str, bus: Bus, output_dir: Path, keep_last: int, options: SenderOptions
) -> WeightSender:
    return module(transport).sender(bus, output_dir, keep_last, options)


def default_fetcher(transport: str, bus: Bus, output_dir: Path | None) -> WeightFetcher | None:
    return module(transport).fetcher(bus, output_dir)


def unavailable_reason(transport: str, **checks: str) -> str | None:
    """Why ``transport`` cannot run in this process, or None when it can. ``checks`` go to the
    transport's own check (``ucx_module="..."`` points the ``ucx`` one at another package)."""
    check = getattr(module(transport), "unavailable", None)
    return None if check is None else check(**checks)
