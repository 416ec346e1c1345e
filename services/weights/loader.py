"""Fetch the adapter a WeightsReady event announces, and refuse it unless it is intact.

Inference calls :func:`load_weights` for each WeightsReady it receives. ``object_store`` and
``filesystem`` are read here; a direct transport (``ucx``, ``collective``) is received by its
:class:`~services.weights.transport.WeightFetcher`. The bytes are checked against the event
before they are parsed: their size against ``size_bytes`` and their sha256
against ``digest``. Whatever goes wrong (a missing or garbage-collected object, a truncated file,
a digest mismatch, a path outside the output directory, bytes that are not an adapter) raises
:class:`WeightsError` naming the run, the step and what was wrong, so the caller reports one
clear error and keeps serving the adapter it already has.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import nats.errors
from torch import Tensor

from schemas.events import WeightsReady
from services.bus import Bus
from services.model.peft_io import (
    ADAPTER_WEIGHTS,
    AdapterFormatError,
    adapter_from_bytes,
    sha256_digest,
)
from services.weights.errors import WeightsError
from services.weights.object_store import BlobError, read_blob
from services.weights.transport import WeightFetcher

__all__ = ["WeightsError", "load_weights"]


async def load_weights(
    bus: Bus,
    event: WeightsReady,
    output_dir: Path | None = None,
    fetchers: Mapping[str, WeightFetcher] | None = None,
) -> dict[str, Tensor]:
    """The adapter state dict (PEFT key names, CPU tensors) that ``event`` announces.

    ``output_dir``, when given, confines the filesystem transport: a location that does not
    resolve inside it is refused, so an event cannot make a replica read an arbitrary file.
    ``fetchers`` maps a transport name to the :class:`WeightFetcher` that receives it (a
    collective group joined at start-up, a UCX client with its own timeouts); ``ucx`` without
    one uses a client shared by the event loop, and any other direct transport without one is
    refused as not available.
    """
    where = f"weights for {event.run_id} step {event.step}"
    fetcher = (fetchers or {}).get(event.transport)
    if fetcher is None and event.transport == "ucx":
        from services.weights.ucx import default_client

        fetcher = default_client()
    if fetcher is not None:
        # A fetcher receives the stream in place and checks its size and digest itself.
        state = await fetcher.fetch(event)
        _check_rank(where, event, state)
        return state
    match event.transport:
        case "object_store":
            try:
                data, digest = await read_blob(bus, event.location, expected_size=event.size_bytes)
            except (BlobError, ValueError) as exc:
                raise WeightsError(f"{where}: {exc}") from exc
            except nats.errors.Error as exc:
                raise WeightsError(
                    f"{where}: reading {event.location!r} failed: {type(exc).__name__}: {exc}"
                ) from exc
        case "filesystem":
            data = await asyncio.to_thread(_read_broadcast_file, where, event, output_dir)
            # Off the event loop: hashing a large adapter takes tens of milliseconds.
            digest = await asyncio.to_thread(sha256_digest, data)
        case other:
            raise WeightsError(
                f"{where}: transport {other!r} is not available in this process (no fetcher "
                "for it was set up; a collective replica joins its group at start-up)"
            )
    if digest != event.digest:
        raise WeightsError(
            f"{where}: digest mismatch: announced {event.digest} but the {len(data)} stored bytes "
            f"hash to {digest}"
        )
    try:
        state = await asyncio.to_thread(adapter_from_bytes, data)
    except AdapterFormatError as exc:
        raise WeightsError(f"{where}: {exc}") from exc
    _check_rank(where, event, state)
    return state


def _read_broadcast_file(where: str, event: WeightsReady, output_dir: Path | None) -> bytes:
    """The safetensors bytes of a broadcast directory, after checking where and how big."""
    path = Path(event.location) / ADAPTER_WEIGHTS
    if output_dir is not None:
        root = Path(output_dir).resolve()
        # Resolving the file, not just the directory, also catches a symlink leading out.
        if not path.resolve().is_relative_to(root):
            raise WeightsError(
                f"{where}: location {event.location!r} is outside the output directory "
                f"{str(root)!r}; refusing to read it"
            )
    try:
        size = path.stat().st_size
        if size != event.size_bytes:
            raise WeightsError(
                f"{where}: size mismatch: announced {event.size_bytes} bytes but {path} holds "
                f"{size} (truncated, or overwritten by another step)"
            )
        data = path.read_bytes()
    except OSError as exc:
        raise WeightsError(
            f"{where}: cannot read {path} ({type(exc).__name__}: {exc.strerror or exc}); "
            "the directory may have been garbage-collected after newer steps were published"
        ) from exc
    if len(data) != event.size_bytes:
        raise WeightsError(
            f"{where}: size mismatch: announced {event.size_bytes} bytes, read {len(data)}"
        )
    return data


def _check_rank(where: str, event: WeightsReady, state: dict[str, Tensor]) -> None:
    """Each LoRA matrix must have the announced rank: A is [rank, in], B is [out, rank]."""
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
                "LoRA matrix as the event announces"
            )
