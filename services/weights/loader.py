"""Fetch the weights a WeightsReady event announces, and refuse them unless they are intact.

Inference calls :func:`load_weights` for each WeightsReady it receives: a run's adapter, or,
from a trainer without LoRA (``event.is_full``), the whole model's state dict. The event's
transport picks the :class:`~services.weights.transport.WeightFetcher` that receives it: one
the caller set up (a collective group joined at start-up, a UCX client with its own timeouts),
else the transport's default from :data:`~services.weights.transport.TRANSPORTS`. Every fetcher
receives through a :class:`~services.weights.stream.StreamDecoder`, which checks the header
against the destination before a byte is written, and the size and digest at the end. Whatever
goes wrong raises :class:`WeightsError` naming the run, the step and what was wrong, so the
caller reports one clear error and keeps serving the version it already has, unless
``WeightsError.touched`` says the destination (the serving model's parameters, for full
weights received in place) was partly overwritten.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from schemas.events import WeightsReady
from schemas.tenant import DEFAULT_TENANT
from services.bus import Bus
from services.weights.errors import WeightsError
from services.weights.transport import WeightFetcher, default_fetcher

__all__ = ["WeightsError", "load_weights"]


async def load_weights(
    bus: Bus,
    event: WeightsReady,
    output_dir: Path | None = None,
    fetchers: Mapping[str, WeightFetcher] | None = None,
    *,
    destination: Mapping[str, Tensor] | None = None,
    tenant: str = DEFAULT_TENANT,
) -> dict[str, Tensor]:
    """The state dict (CPU tensors) that ``event`` announces: an adapter with PEFT key names,
    or, for ``event.is_full``, the model's parameters with their Hugging Face names.

    ``destination``, when given, receives the tensors in place: the stream must hold exactly
    its tensors, each with the same dtype and shape (checked before anything is written), and
    the result maps each name to the destination's own tensor. ``output_dir``, when given,
    confines the filesystem transport: a location that does not resolve inside it is refused.
    ``fetchers`` maps a transport name to the fetcher that receives it; a transport without one
    and without a default (``collective``) is refused as not available. ``tenant`` is the
    tenant whose subject announced ``event``: the object store transport reads from its store.
    """
    where = f"weights for {event.run_id} step {event.step}"
    fetcher = (fetchers or {}).get(event.transport)
    if fetcher is None:
        fetcher = default_fetcher(event.transport, bus, output_dir)
    if fetcher is None:
        raise WeightsError(
            f"{where}: transport {event.transport!r} is not available in this process (no "
            "fetcher for it was set up; a collective replica joins its group at start-up)"
        )
    state = await fetcher.fetch(event, destination=destination, tenant=tenant)
    _check_rank(where, event, state, touched=destination is not None)
    return state


def _check_rank(
    where: str, event: WeightsReady, state: dict[str, Tensor], *, touched: bool = False
) -> None:
    """Each LoRA matrix of an adapter must have the announced rank: A is [rank, in], B is
    [out, rank]. Full weights have no rank to check."""
    if event.is_full:
        return
    rank = event.lora.rank
    for key, tensor in state.items():
        if key.endswith("lora_A.weight"):
            got = tensor.shape[0] if tensor.dim() == 2 else None
        elif key.endswith("lora_B.weight"):
            got = tensor.shape[1] if tensor.dim() == 2 else None
        else:
            continue
        if got != rank:
            raise WeightsError(
                f"{where}: {key} has shape {tuple(tensor.shape)}, which is not a rank-{rank} "
                "LoRA matrix as the event announces",
                touched=touched,
            )
