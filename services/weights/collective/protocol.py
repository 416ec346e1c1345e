"""The collective protocol: constants, frames, buckets, and the gloo groups they travel in.
Shared by :mod:`.sender` and :mod:`.receiver`; the membership messages are in
:mod:`schemas.collective`."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import msgspec
import torch
from torch import Tensor

from schemas.events import WeightsReady
from schemas.subjects import DEFAULT_COLLECTIVE_GROUP
from services.weights.buckets import bucket_pieces, bucket_plan
from services.weights.errors import WeightsError
from services.weights.stream import EncodedStream

DEFAULT_GROUP = DEFAULT_COLLECTIVE_GROUP
# Seconds, and generations tried in a row: what each bounds is in the package's docstring.
TIMEOUT = 30.0
HEARTBEAT = 2.0  # well under TIMEOUT
PING_TIMEOUT = 2.0
JOIN_TIMEOUT = 5.0
REJOIN_INTERVAL = 1.0
FETCH_TIMEOUT = 60.0
MAX_FORM_ATTEMPTS = 3
MAGIC = 0x504C5843  # "PLXC"
MAX_FRAME_BYTES = 64 << 20


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
    if views is None:
        discard = torch.empty(bucket_bytes, dtype=torch.uint8)
        for bucket in bucket_plan(lengths, bucket_bytes):
            _broadcast(pg, discard[: sum(stop - start for _, start, stop in bucket)])
        return
    # One piece at a time, so every shared bucket can go through the same buffer.
    for piece, then in bucket_pieces(
        views, bucket_bytes, sending=sending, landed=landed, reuse=True
    ):
        _broadcast(pg, torch.frombuffer(piece, dtype=torch.uint8))
        if then is not None:
            then()


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
