"""Fetch the weights a WeightsReady event announces, and refuse them unless they are intact.

Inference calls :func:`load_weights` for each WeightsReady it receives: a run's adapter, or,
from a trainer without LoRA (``event.is_full``), the whole model's state dict. ``object_store``
and ``filesystem`` are read here; a direct transport (``ucx``, ``collective``) is received by
its :class:`~services.weights.transport.WeightFetcher`. The bytes are checked against the event:
their size against ``size_bytes`` and their sha256 against ``digest``. Whatever goes wrong (a
missing or garbage-collected object, a truncated file, a digest mismatch, a path outside the
output directory, bytes that are not safetensors, tensors that do not fit the destination)
raises :class:`WeightsError` naming the run, the step and what was wrong, so the caller reports
one clear error and keeps serving the version it already has.

Two ways in. An adapter without a ``destination`` is read whole (it is small), checked, then
parsed. Full weights, and anything with a ``destination``, are received as a stream
(:class:`~services.weights.stream.StreamDecoder`): the header first, checked against the
destination before a byte is written; then the data straight into the tensors (the object
store's chunks as they arrive, the file with ``readinto``), hashed while it lands. A model is
never held twice: not as a blob beside its tensors, and, with a destination (the serving
model's parameters), not beside the parameters either (parameters on a GPU are the exception:
they are received into host memory and copied in once the digest matched). A failure after the
data started to land in place has ``WeightsError.touched`` set: the destination is partly
overwritten and holds no usable version until a good one lands.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from io import FileIO
from pathlib import Path

import nats.errors
from torch import Tensor

from schemas.events import WeightsReady
from services.bus import Bus
from services.model.peft_io import (
    ADAPTER_WEIGHTS,
    FULL_WEIGHTS_FILE,
    AdapterFormatError,
    adapter_from_bytes,
    sha256_digest,
)
from services.weights.errors import WeightsError
from services.weights.object_store import BlobError, read_blob, stream_blob
from services.weights.stream import CHUNK_BYTES, StreamDecoder, split
from services.weights.transport import WeightFetcher

__all__ = ["WeightsError", "load_weights"]


async def load_weights(
    bus: Bus,
    event: WeightsReady,
    output_dir: Path | None = None,
    fetchers: Mapping[str, WeightFetcher] | None = None,
    *,
    destination: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """The state dict (CPU tensors) that ``event`` announces: an adapter with PEFT key names,
    or, for ``event.is_full``, the model's parameters with their Hugging Face names.

    ``destination``, when given, receives the tensors in place: the stream must hold exactly
    its tensors, each with the same dtype and shape (checked before anything is written), and
    the result maps each name to the destination's own tensor. ``output_dir``, when given,
    confines the filesystem transport: a location that does not resolve inside it is refused,
    so an event cannot make a replica read an arbitrary file. ``fetchers`` maps a transport
    name to the :class:`WeightFetcher` that receives it (a collective group joined at
    start-up, a UCX client with its own timeouts); ``ucx`` without one uses a client shared by
    the event loop, and any other direct transport without one is refused as not available.
    """
    where = f"weights for {event.run_id} step {event.step}"
    fetcher = (fetchers or {}).get(event.transport)
    if fetcher is None and event.transport == "ucx":
        from services.weights.ucx import default_client

        fetcher = default_client()
    if fetcher is not None:
        # A fetcher receives the stream in place and checks its size and digest itself.
        state = await fetcher.fetch(event, destination=destination)
        _check_rank(where, event, state, touched=destination is not None)
        return state
    if event.transport not in ("object_store", "filesystem"):
        raise WeightsError(
            f"{where}: transport {event.transport!r} is not available in this process (no "
            "fetcher for it was set up; a collective replica joins its group at start-up)"
        )
    if event.is_full or destination is not None:
        decoder = StreamDecoder(where, event.size_bytes, event.digest, destination)
        if event.transport == "object_store":
            await _stream_object(bus, event, decoder)
        else:
            await asyncio.to_thread(_read_file_into, event, output_dir, decoder)
        # Off the event loop: the rest of the digest may still be hashing.
        state = await asyncio.to_thread(decoder.finish)
        _check_rank(where, event, state, touched=destination is not None)
        return state
    if event.transport == "object_store":
        try:
            data, digest = await read_blob(bus, event.location, expected_size=event.size_bytes)
        except (BlobError, ValueError, nats.errors.Error) as exc:
            raise _read_failed(where, event, exc) from exc
    else:
        data = await asyncio.to_thread(_read_broadcast_file, where, event, output_dir)
        # Off the event loop: hashing a large adapter takes tens of milliseconds.
        digest = await asyncio.to_thread(sha256_digest, data)
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


async def _stream_object(bus: Bus, event: WeightsReady, decoder: StreamDecoder) -> None:
    """The object's chunks into ``decoder`` as they arrive (a chunk straddles tensors)."""
    where = decoder.where
    try:
        await stream_blob(
            bus,
            event.location,
            decoder.feed,
            expected_size=event.size_bytes,
            expected_digest=event.digest,
        )
    except BaseException as exc:
        decoder.abandon()
        if isinstance(exc, BlobError | ValueError | nats.errors.Error):
            raise _read_failed(where, event, exc, touched=decoder.touched) from exc
        raise


def _read_failed(
    where: str, event: WeightsReady, exc: Exception, *, touched: bool = False
) -> WeightsError:
    """What a failed object-store read is reported as: the store's own words for a missing,
    replaced or short object, the client's error for a connection that failed."""
    if isinstance(exc, nats.errors.Error):
        return WeightsError(
            f"{where}: reading {event.location!r} failed: {type(exc).__name__}: {exc}",
            touched=touched,
        )
    return WeightsError(f"{where}: {exc}", touched=touched)


def _read_file_into(event: WeightsReady, output_dir: Path | None, decoder: StreamDecoder) -> None:
    """The broadcast file's header into ``decoder``, then its data straight into the targets."""
    where = decoder.where
    path = _broadcast_path(where, event, output_dir)
    try:
        with path.open("rb", buffering=0) as file:
            size = os.fstat(file.fileno()).st_size
            if size != event.size_bytes:
                raise WeightsError(
                    f"{where}: size mismatch: announced {event.size_bytes} bytes but {path} "
                    f"holds {size} (truncated, or overwritten by another step)"
                )
            prefix = _read_exactly(file, 8, where, path)
            length = StreamDecoder.header_length(prefix, event.size_bytes, where)
            decoder.feed_header(prefix + _read_exactly(file, length, where, path))
            done = 0
            for piece in split(decoder.targets(), CHUNK_BYTES):
                while len(piece):
                    got = file.readinto(piece)
                    if not got:
                        raise WeightsError(
                            f"{where}: {path} ended after {8 + length + done} of its "
                            f"{event.size_bytes} bytes (truncated while read)",
                            touched=decoder.touched,
                        )
                    piece = piece[got:]
                    done += got
                # The bytes in place so far are hashed on another thread while more are read.
                decoder.landed(done)
    except OSError as exc:
        decoder.abandon()
        raise WeightsError(
            f"{where}: cannot read {path} ({type(exc).__name__}: {exc.strerror or exc}); "
            "the directory may have been garbage-collected after newer steps were published",
            touched=decoder.touched,
        ) from exc
    except BaseException:
        decoder.abandon()
        raise


def _read_exactly(file: FileIO, count: int, where: str, path: Path) -> bytes:
    data = file.read(count)
    if len(data) != count:
        raise WeightsError(f"{where}: {path} ended inside its header (truncated while read)")
    return data


def _broadcast_path(where: str, event: WeightsReady, output_dir: Path | None) -> Path:
    """The safetensors file of a broadcast directory, refused when it is outside ``output_dir``."""
    name = FULL_WEIGHTS_FILE if event.is_full else ADAPTER_WEIGHTS
    path = Path(event.location) / name
    if output_dir is not None:
        root = Path(output_dir).resolve()
        # Resolving the file, not just the directory, also catches a symlink leading out.
        if not path.resolve().is_relative_to(root):
            raise WeightsError(
                f"{where}: location {event.location!r} is outside the output directory "
                f"{str(root)!r}; refusing to read it"
            )
    return path


def _read_broadcast_file(where: str, event: WeightsReady, output_dir: Path | None) -> bytes:
    """The safetensors bytes of a broadcast directory, after checking where and how big."""
    path = _broadcast_path(where, event, output_dir)
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
