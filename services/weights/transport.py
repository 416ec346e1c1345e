"""The two ends of a direct weight transport, and whether one can run on this machine.

The object store and the filesystem are built into the publisher and the loader. A direct
transport (``ucx``, ``collective``) plugs in as a :class:`WeightSender` on the trainer, which
holds or pushes an :class:`~services.weights.stream.EncodedStream` and says where it is, and a
:class:`WeightFetcher` on each inference replica, which receives what a WeightsReady announces.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Collection, Mapping
from typing import Protocol

from torch import Tensor

from schemas.events import WeightsReady
from services.weights.stream import EncodedStream

DIRECT_TRANSPORTS = ("ucx", "collective")


class WeightSender(Protocol):
    """The trainer's end: makes a run's adapter at a step available and says where."""

    name: str

    async def start(self) -> None:
        """Listen, join a group: whatever must be up before the first :meth:`send`."""
        ...

    async def send(self, run_id: str, step: int, stream: EncodedStream) -> str:
        """Offer ``stream`` as ``run_id``'s weights at ``step``; the WeightsReady location."""
        ...

    async def forget(self, run_id: str, steps: Collection[int]) -> None:
        """Drop what is held of those steps (garbage collection of old versions)."""
        ...

    async def close(self) -> None: ...


class WeightFetcher(Protocol):
    """An inference replica's end: the tensors a WeightsReady announces, size and digest checked.

    Raises :class:`~services.weights.errors.WeightsError` naming the run and step for anything
    that goes wrong. With ``destination``, tensors are received in place into those tensors.
    """

    async def fetch(
        self, event: WeightsReady, destination: Mapping[str, Tensor] | None = None
    ) -> dict[str, Tensor]: ...

    async def close(self) -> None: ...


def unavailable_reason(transport: str, *, ucx_module: str = "ucxx") -> str | None:
    """Why ``transport`` cannot run in this process, or None when it can.

    ``ucx`` needs the ``ucxx`` package (``pip install -e '.[ucx]'``) to import; ``collective``
    needs torch.distributed and :mod:`services.weights.collective`. ``ucx_module`` names the
    module to try, so a test can point it at one that is missing.
    """
    if transport == "ucx":
        try:
            from services.weights.ucx import import_ucxx

            import_ucxx(ucx_module)
        except ImportError as exc:
            return (
                f"weight transport 'ucx' needs the {ucx_module!r} package, which cannot be "
                f"imported here ({exc}); install it with pip install -e '.[ucx]' or choose "
                "another transport"
            )
        return None
    if transport == "collective":
        import torch.distributed

        if not torch.distributed.is_available():
            return (
                "weight transport 'collective' needs torch.distributed, which this torch "
                "build does not have; choose another transport"
            )
        if importlib.util.find_spec("services.weights.collective") is None:
            return (
                "weight transport 'collective' is not part of this build "
                "(services.weights.collective is missing); choose another transport"
            )
        return None
    return None
