"""A state dict as a safetensors byte stream, sent and received without a copy of the whole file.

An adapter is small enough to travel as one ``bytes`` object; a whole model is not, and no
transport assembles one. :class:`EncodedStream` describes a state dict as the bytes of a
safetensors file without assembling them: the header, then each tensor's own memory viewed as
bytes. :class:`StreamDecoder` is the other end: it parses the header, allocates the tensors (or,
given ``destination``, checks and reuses tensors that exist already, such as a model's own
parameters) and hands the transport writable views of their memory to receive into, or takes
the stream piece by piece as it comes (:meth:`StreamDecoder.feed`, the object store's chunks).
The digest, ``sha256:<hex>`` of the whole file as in ``WeightsReady.digest``, is computed once on
each side over the same views.

The layout is standard safetensors, so :meth:`EncodedStream.to_bytes` is a file that
``safetensors.torch.load`` reads: an 8-byte little-endian header length, a JSON header mapping
each tensor name to its ``dtype``, ``shape`` and ``data_offsets`` (plus ``__metadata__``,
``{"format": "pt"}``), padded with spaces to a multiple of 8 bytes, then the tensors' bytes, one
after the other in the order of their (sorted) names.

A transport moves the data part as :func:`split` cuts it: each tensor's bytes in pieces of at
most ``chunk_bytes``, a piece never spanning two tensors (so it is a view, not a copy); or as
:func:`bucket_plan` cuts it, which also puts the pieces of small tensors together in shared
buckets copied through a buffer, so that an adapter of hundreds of small tensors travels in a
few messages rather than one per tensor. Sender and receiver cut the same way, so piece ``k`` on
one side is piece ``k`` on the other.
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from services.model.lora import preview_keys
from services.weights.errors import WeightsError

CHUNK_BYTES = 8 << 20
"""Default piece size: large enough that per-message costs vanish, small enough to pipeline."""

COALESCE_BELOW = 1 << 20
"""Pieces smaller than this (or than half a bucket) share buckets, copied through a buffer."""

MAX_HEADER_BYTES = 100_000_000
"""The largest header accepted; the limit the safetensors library itself enforces."""

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_METADATA = "__metadata__"


def byte_view(tensor: Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a flat ``uint8`` memoryview (no copy; writable)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data.cast("B")


def split(views: Iterable[memoryview], chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
    """``views`` cut into pieces of at most ``chunk_bytes``; empty views give no piece."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    for view in views:
        for start in range(0, len(view), chunk_bytes):
            yield view[start : start + chunk_bytes]


def bucket_plan(lengths: Sequence[int], bucket_bytes: int) -> list[list[tuple[int, int, int]]]:
    """How a stream's data travels: buckets of ``(segment, start, stop)`` pieces, in order.

    Each segment (tensor) is cut into pieces of at most ``bucket_bytes``. A piece of at least
    ``min(COALESCE_BELOW, bucket_bytes // 2)`` bytes is a bucket of its own, broadcast as a view
    of the tensor's memory on both ends (no copy); smaller pieces share buckets of at most
    ``bucket_bytes``, copied through a buffer. Sender and receiver compute the same plan from the
    same lengths, so bucket ``k`` has the same size on every rank.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    alone = max(1, min(COALESCE_BELOW, bucket_bytes // 2))
    plan: list[list[tuple[int, int, int]]] = []
    shared: list[tuple[int, int, int]] = []
    filled = 0
    for i, length in enumerate(lengths):
        for start in range(0, length, bucket_bytes):
            stop = min(length, start + bucket_bytes)
            if stop - start >= alone:
                plan.append([(i, start, stop)])
                continue
            if filled + stop - start > bucket_bytes:
                plan.append(shared)
                shared, filled = [], 0
            shared.append((i, start, stop))
            filled += stop - start
    if shared:
        plan.append(shared)
    return plan


def gather(
    buffer: memoryview, bucket: Sequence[tuple[int, int, int]], views: Sequence[memoryview]
) -> None:
    """Copy a shared bucket's pieces (``(segment, start, stop)`` of ``views``) into ``buffer``."""
    offset = 0
    for i, start, stop in bucket:
        buffer[offset : offset + stop - start] = views[i][start:stop]
        offset += stop - start


def scatter(
    buffer: memoryview, bucket: Sequence[tuple[int, int, int]], views: Sequence[memoryview]
) -> None:
    """The inverse of :func:`gather`: a received shared bucket's bytes to their segments."""
    offset = 0
    for i, start, stop in bucket:
        views[i][start:stop] = buffer[offset : offset + stop - start]
        offset += stop - start


class LandedPrefix:
    """Turns finished buckets into the stream-order prefix of bytes in place.

    Small pieces wait in a shared bucket that travels after the large pieces behind them, so
    buckets finish out of stream order; ``landed`` hears how far the data is complete from the
    start, which is what a digest computed while receiving needs."""

    def __init__(
        self,
        lengths: Sequence[int],
        plan: Sequence[Sequence[tuple[int, int, int]]],
        landed: Callable[[int], None],
    ) -> None:
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        # (global start, global stop, bucket) of every piece, in stream order
        self._pieces = sorted(
            (starts[i] + a, starts[i] + b, k) for k, bucket in enumerate(plan) for i, a, b in bucket
        )
        self._done: set[int] = set()
        self._next = 0
        self._landed = landed

    def bucket_done(self, k: int) -> None:
        self._done.add(k)
        advanced = False
        while self._next < len(self._pieces) and self._pieces[self._next][2] in self._done:
            self._next += 1
            advanced = True
        if advanced:
            self._landed(self._pieces[self._next - 1][1])


Piece = tuple[memoryview, Callable[[], None] | None]
"""A message's bytes, and what to do once it is through (None: nothing)."""


def bucket_pieces(
    views: Sequence[memoryview],
    bucket_bytes: int,
    *,
    sending: bool,
    landed: Callable[[int], None] | None = None,
    reuse: bool = False,
) -> Iterator[Piece]:
    """The data of ``views`` by :func:`bucket_plan`, one piece per bucket, made as it is asked
    for. A bucket of one slice is a view of its tensor; a shared bucket is gathered into a
    buffer before it is sent, and scattered to its tensors once it is received. ``landed``
    hears the stream-order prefix of bytes in place as buckets finish. ``reuse``: every shared
    bucket goes through one buffer, for a caller that moves one piece at a time; otherwise each
    has its own, so several can be in flight."""
    lengths = [len(v) for v in views]
    plan = bucket_plan(lengths, bucket_bytes)
    progress = LandedPrefix(lengths, plan, landed) if landed is not None else None
    largest = max((_bucket_bytes(b) for b in plan if len(b) > 1), default=0)
    buffer = memoryview(bytearray(largest)) if reuse else None
    for k, bucket in enumerate(plan):
        done = None if progress is None else functools.partial(progress.bucket_done, k)
        if len(bucket) == 1:
            i, start, stop = bucket[0]
            yield views[i][start:stop], done
            continue
        nbytes = _bucket_bytes(bucket)
        piece = buffer[:nbytes] if buffer is not None else memoryview(bytearray(nbytes))
        if sending:
            gather(piece, bucket, views)
            yield piece, done
        else:
            yield piece, _then(functools.partial(scatter, piece, bucket, views), done)


def _bucket_bytes(bucket: Sequence[tuple[int, int, int]]) -> int:
    return sum(stop - start for _, start, stop in bucket)


def _then(first: Callable[[], None], second: Callable[[], None] | None) -> Callable[[], None]:
    if second is None:
        return first

    def both() -> None:
        first()
        second()

    return both


class EncodedStream:
    """The safetensors bytes of a state dict, as views of the tensors themselves (sender side).

    Build it with :meth:`from_state_dict`. The tensors are referenced, not copied: the caller
    must not modify them while the stream is being sent (the publisher hands in a snapshot).
    """

    def __init__(self, header: bytes, tensors: list[tuple[str, Tensor]]) -> None:
        self.header = header
        self.names = [name for name, _ in tensors]
        self._tensors = [t for _, t in tensors]  # keeps the memory behind the views alive
        self._views = [byte_view(t) for t in self._tensors]
        self.size = len(header) + sum(len(v) for v in self._views)
        hasher = hashlib.sha256(header)
        for view in self._views:
            hasher.update(view)
        self.digest = "sha256:" + hasher.hexdigest()

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> EncodedStream:
        """Encode ``state``: each tensor made contiguous and CPU (no copy when it is already)."""
        if not state:
            raise ValueError("refusing to encode a state dict with no tensors")
        tensors: list[tuple[str, Tensor]] = []
        entries: dict[str, Any] = {_METADATA: {"format": "pt"}}
        offset = 0
        for name in sorted(state):
            if not isinstance(name, str) or not name or name == _METADATA:
                raise ValueError(f"cannot encode a tensor named {name!r}")
            tensor = state[name].detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            code = _CODES.get(tensor.dtype)
            if code is None:
                raise ValueError(
                    f"cannot encode {name!r}: dtype {tensor.dtype} has no safetensors code "
                    f"here (supported: {', '.join(str(d) for d in _CODES)})"
                )
            nbytes = tensor.numel() * tensor.element_size()
            entries[name] = {
                "dtype": code,
                "shape": list(tensor.shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            tensors.append((name, tensor))
        body = json.dumps(entries, separators=(",", ":")).encode()
        body += b" " * (-len(body) % 8)
        return cls(struct.pack("<Q", len(body)) + body, tensors)

    def segments(self) -> Iterator[memoryview]:
        """The header, then each tensor's bytes (zero copy), in stream order."""
        yield memoryview(self.header)
        yield from self._views

    def data_segments(self) -> list[memoryview]:
        """Each tensor's bytes (zero copy), in stream order: everything after the header."""
        return list(self._views)

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The same bytes as :meth:`segments` in pieces of at most ``chunk_bytes``."""
        return split(self.segments(), chunk_bytes)

    def to_bytes(self) -> bytes:
        """The whole safetensors file in one ``bytes`` (for tests and small adapters)."""
        return b"".join(self.segments())


class _Entry:
    __slots__ = ("begin", "dtype", "end", "name", "shape")

    def __init__(self, name: str, dtype: torch.dtype, shape: list[int], begin: int, end: int):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


class StreamDecoder:
    """Receives a safetensors stream into tensors, then checks its size and digest.

    ``where`` starts every error message (``"weights for run_a step 3"``). ``size`` and
    ``digest`` are what the announcement says the whole stream is. With ``destination``, the
    stream must hold exactly the destination's tensors, each with the same dtype and shape,
    which :meth:`feed_header` checks before a byte is written. Contiguous CPU tensors are
    received straight into (full-weight mode: no second copy); a transfer that fails after that
    leaves them partly overwritten, and every WeightsError raised from then on has ``touched``
    set (see :attr:`touched`), so the caller knows the destination holds no usable version any
    more. Any other destination tensor (on a GPU, or not contiguous) is received into a CPU
    tensor of its own and copied into the destination by :meth:`finish`, after the digest
    matched: a failed transfer leaves such tensors as they were.
    """

    def __init__(
        self,
        where: str,
        size: int,
        digest: str,
        destination: Mapping[str, Tensor] | None = None,
    ) -> None:
        self.where = where
        self.size = size
        self.digest = digest
        self.destination = destination
        self._header: bytes | None = None
        self._tensors: dict[str, Tensor] = {}
        self._views: list[memoryview] = []
        self._handed_out = False
        # (destination tensor, the CPU tensor its bytes land in), for those not written in place
        self._staged: list[tuple[Tensor, Tensor]] = []
        # What :meth:`feed` has taken so far: the header's bytes until it is complete, then how
        # many data bytes are in place and where the next one goes (a view and an offset in it).
        self._pending = bytearray()
        self._fed: int | None = None
        self._cursor = (0, 0)
        # Hashing while the data arrives (see ``landed``): the bytes landed so far, in stream
        # order, and the thread that hashes up to there.
        self._landed = 0
        self._abandoned = False
        self._progress = threading.Condition()
        self._hasher: threading.Thread | None = None
        self._hashed: str | None = None

    @property
    def touched(self) -> bool:
        """Whether the destination may hold some of this stream's bytes: true once views of
        its own tensors (not only staged ones) were handed out for writing (:meth:`targets`,
        :meth:`feed`); never without a destination. A failed copy of the staged tensors in
        :meth:`finish` raises with ``touched`` set itself."""
        in_place = len(self._staged) < len(self._views)
        return self.destination is not None and self._handed_out and in_place

    @staticmethod
    def header_length(
        prefix8: bytes, size: int | None = None, where: str = "safetensors stream"
    ) -> int:
        """The header's JSON length from the 8-byte prefix, checked against ``size`` if given."""
        if len(prefix8) != 8:
            raise WeightsError(
                f"{where}: a safetensors stream starts with an 8-byte header length, got "
                f"{len(prefix8)} bytes"
            )
        (length,) = struct.unpack("<Q", bytes(prefix8))
        limit = MAX_HEADER_BYTES if size is None else min(MAX_HEADER_BYTES, size - 8)
        if not 2 <= length <= limit:
            total = "" if size is None else f" of a {size}-byte stream"
            raise WeightsError(
                f"{where}: the header length prefix{total} says {length} bytes, which cannot "
                f"be (at most {max(limit, 0)}); the data is not safetensors"
            )
        return int(length)

    def feed_header(self, header: bytes) -> None:
        """Parse and check the whole header (prefix included), then allocate the tensors."""
        if self._header is not None:
            raise WeightsError(f"{self.where}: the header was fed twice")
        where = self.where
        length = self.header_length(bytes(header[:8]), self.size, where)
        if len(header) != 8 + length:
            raise WeightsError(
                f"{where}: the header length prefix says {length} bytes, {len(header) - 8} "
                "were given"
            )
        entries = self._parse(bytes(header[8:]))
        data_bytes = entries[-1].end if entries else 0
        if len(header) + data_bytes != self.size:
            raise WeightsError(
                f"{where}: size mismatch: the header describes {len(header) + data_bytes} "
                f"bytes ({len(header)} of header, {data_bytes} of tensors), {self.size} were "
                "announced"
            )
        if self.destination is not None:
            check_fits(where, [(e.name, e.dtype, e.shape) for e in entries], self.destination)
        landing = {e.name: self._target(e) for e in entries}
        self._views = [byte_view(t) for t in landing.values()]
        if self.destination is None:
            self._tensors = landing
        else:
            self._tensors = {name: self.destination[name] for name in landing}
        self._header = bytes(header)

    def targets(self) -> list[memoryview]:
        """Writable flat byte views of the tensors, in stream order, for the transport to fill."""
        if self._header is None:
            raise WeightsError(f"{self.where}: targets() before feed_header()")
        self._handed_out = True
        return list(self._views)

    def feed(self, piece: bytes | bytearray | memoryview) -> None:
        """Take the next ``piece`` of the whole stream (header included), cut anywhere.

        For a transport that delivers the file as a sequence of pieces that straddle the header
        and the tensors (the object store's chunks): the header is collected and checked, then
        each byte is copied straight into its tensor, and the bytes in place are hashed as they
        land (:meth:`landed`). Use either this or :meth:`feed_header` and :meth:`targets`; end
        with :meth:`finish`, or :meth:`abandon` when the transfer fails."""
        view = memoryview(piece).cast("B")
        if self._fed is None:
            if self._header is not None:
                raise WeightsError(f"{self.where}: feed() after feed_header()")
            view = self._take_header(view)
            if self._fed is None:
                return
        if not len(view):
            return
        views = self._views
        index, offset = self._cursor
        while len(view):
            while index < len(views) and offset == len(views[index]):
                index, offset = index + 1, 0
            if index == len(views):
                raise WeightsError(
                    f"{self.where}: more bytes than the {self.size} the header describes",
                    touched=self.touched,
                )
            take = min(len(views[index]) - offset, len(view))
            views[index][offset : offset + take] = view[:take]
            view = view[take:]
            offset += take
            self._fed += take
        self._cursor = (index, offset)
        self.landed(self._fed)

    def _take_header(self, view: memoryview) -> memoryview:
        """Collect the header from the front of ``view``; what follows it, once it is whole."""
        pending = self._pending
        if len(pending) < 8:
            take = min(8 - len(pending), len(view))
            pending += view[:take]
            view = view[take:]
            if len(pending) < 8:
                return view
        need = 8 + self.header_length(bytes(pending[:8]), self.size, self.where)
        take = min(need - len(pending), len(view))
        pending += view[:take]
        if len(pending) < need:
            return view[len(view) :]
        self.feed_header(bytes(pending))
        self._pending = bytearray()
        self._handed_out = True
        self._fed = 0
        return view[take:]

    def landed(self, nbytes: int) -> None:
        """Tell the decoder that the first ``nbytes`` of tensor data (stream order, header not
        counted) are in place. The first call starts a thread that hashes up to there while the
        rest arrives, so on 2 cores the digest check mostly overlaps the transfer instead of
        following it (sha256 runs at about 1.5 GB/s on one core here; a transfer on loopback at
        1.5-3 GB/s). A transport that never calls it gets the whole hash in ``finish``; one
        that does must call ``finish`` or ``abandon``."""
        if self._header is None:
            raise WeightsError(f"{self.where}: landed() before feed_header()")
        with self._progress:
            self._landed = max(self._landed, nbytes)
            self._progress.notify()
        if self._hasher is None:
            self._hasher = threading.Thread(
                target=self._hash_as_landed, name="plexrl-digest", daemon=True
            )
            self._hasher.start()

    def abandon(self) -> None:
        """The transfer failed: stop the hashing thread (the tensors are not to be used)."""
        with self._progress:
            self._abandoned = True
            self._progress.notify()
        if self._hasher is not None:
            self._hasher.join()

    def finish(self) -> dict[str, Tensor]:
        """The received tensors, after checking the total size and the sha256 digest."""
        if self._header is None:
            raise WeightsError(f"{self.where}: nothing was received (no header)")
        data_bytes = sum(len(v) for v in self._views)
        received = len(self._header) + (data_bytes if self._fed is None else self._fed)
        if received != self.size:
            self.abandon()
            raise WeightsError(
                f"{self.where}: size mismatch: announced {self.size} bytes, received {received}",
                touched=self.touched,
            )
        if self._hasher is not None:
            self.landed(data_bytes)
            self._hasher.join()
            assert self._hashed is not None
            got = self._hashed
        else:
            hasher = hashlib.sha256(self._header)
            for view in self._views:
                hasher.update(view)
            got = "sha256:" + hasher.hexdigest()
        if got != self.digest:
            raise WeightsError(
                f"{self.where}: digest mismatch: announced {self.digest} but the {received} "
                f"received bytes hash to {got}",
                touched=self.touched,
            )
        self._copy_staged()
        return dict(self._tensors)

    def _copy_staged(self) -> None:
        """The staged tensors into their destination tensors."""
        try:
            with torch.no_grad():
                for target, staged in self._staged:
                    target.copy_(staged)
        except RuntimeError as exc:  # a device out of memory, or gone
            raise WeightsError(
                f"{self.where}: copying the received tensors into the destination failed "
                f"({type(exc).__name__}: {exc})",
                touched=True,
            ) from exc

    def _hash_as_landed(self) -> None:
        assert self._header is not None
        hasher = hashlib.sha256(self._header)
        total = sum(len(v) for v in self._views)
        done = index = offset = 0  # bytes hashed; the view and the offset in it where they end
        while done < total:
            with self._progress:
                while not (self._abandoned or self._landed > done):
                    self._progress.wait()
                if self._abandoned:
                    return
                mark = min(self._landed, total)
            while done < mark:  # outside the lock; hashlib releases the GIL on large updates
                view = self._views[index]
                take = min(len(view) - offset, mark - done)
                hasher.update(view[offset : offset + take])
                done += take
                offset += take
                if offset == len(view):
                    index, offset = index + 1, 0
        self._hashed = "sha256:" + hasher.hexdigest()

    # --- inside feed_header -------------------------------------------------------------------

    def _parse(self, body: bytes) -> list[_Entry]:
        """The header's tensors in stream order; WeightsError for anything not safetensors."""
        where = self.where
        try:
            parsed = json.loads(body.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
            raise WeightsError(
                f"{where}: the safetensors header is not JSON ({exc}); leading bytes {body[:32]!r}"
            ) from None
        if not isinstance(parsed, dict):
            raise WeightsError(
                f"{where}: the safetensors header is a JSON {type(parsed).__name__}, not an object"
            )
        metadata = parsed.pop(_METADATA, {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise WeightsError(f"{where}: __metadata__ must map strings to strings")
        if not parsed:
            raise WeightsError(f"{where}: the safetensors header lists no tensors")
        entries = [self._entry(name, info) for name, info in parsed.items()]
        entries.sort(key=lambda e: (e.begin, e.end))
        offset = 0
        for entry in entries:
            if entry.begin != offset:
                raise WeightsError(
                    f"{where}: tensor {entry.name!r} starts at byte {entry.begin} of the data, "
                    f"the previous one ends at {offset}: data_offsets must be contiguous"
                )
            offset = entry.end
        return entries

    def _entry(self, name: str, info: Any) -> _Entry:
        where = self.where
        if not isinstance(info, dict):
            raise WeightsError(f"{where}: header entry {name!r} is not an object")
        code, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        dtype = _DTYPES.get(code) if isinstance(code, str) else None
        if dtype is None:
            raise WeightsError(
                f"{where}: tensor {name!r} has unknown dtype {code!r} (known: {', '.join(_DTYPES)})"
            )
        if not (isinstance(shape, list) and all(_is_count(d) for d in shape)):
            raise WeightsError(f"{where}: tensor {name!r} has invalid shape {shape!r}")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(_is_count(o) for o in offsets)
            and offsets[0] <= offsets[1]
        ):
            raise WeightsError(f"{where}: tensor {name!r} has invalid data_offsets {offsets!r}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if offsets[1] - offsets[0] != nbytes:
            raise WeightsError(
                f"{where}: tensor {name!r} ({code} {shape}) needs {nbytes} bytes, its "
                f"data_offsets {offsets} span {offsets[1] - offsets[0]}"
            )
        return _Entry(name, dtype, shape, offsets[0], offsets[1])

    def _target(self, entry: _Entry) -> Tensor:
        """Where ``entry``'s bytes land: a fresh tensor; or the destination's own tensor
        (:func:`check_fits` has checked its dtype and shape) when it is a contiguous CPU tensor,
        else a CPU tensor staged for :meth:`finish` to copy into it."""
        if self.destination is None:
            return torch.empty(entry.shape, dtype=entry.dtype)
        tensor = self.destination[entry.name]
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            return tensor
        staged = torch.empty(entry.shape, dtype=entry.dtype)
        self._staged.append((tensor, staged))
        return staged


def check_fits(
    where: str,
    tensors: Iterable[tuple[str, torch.dtype, list[int]]],
    destination: Mapping[str, Tensor],
) -> None:
    """Refuse a stream of ``(name, dtype, shape)`` tensors that ``destination`` cannot take as
    it is: the same names, and each with the same dtype and shape (no conversion in place)."""
    described = {name: (dtype, list(shape)) for name, dtype, shape in tensors}
    missing = sorted(set(described) - set(destination))
    if missing:
        raise WeightsError(
            f"{where}: the destination has no tensor {_names(missing)}; the stream must hold "
            "exactly the destination's tensors (weights of another model?)"
        )
    unsent = sorted(set(destination) - set(described))
    if unsent:
        raise WeightsError(
            f"{where}: the stream has no tensor {_names(unsent)} of the destination; the stream "
            "must hold exactly the destination's tensors (weights of another model?)"
        )
    for name, (dtype, shape) in described.items():
        tensor = destination[name]
        if tensor.dtype != dtype:
            raise WeightsError(
                f"{where}: tensor {name!r} is {dtype} {shape} in the stream but {tensor.dtype} "
                f"{list(tensor.shape)} in the destination: the trainer and inference must use "
                "the same dtype"
            )
        if list(tensor.shape) != shape:
            raise WeightsError(
                f"{where}: tensor {name!r} is {dtype} {shape} in the stream but {tensor.dtype} "
                f"{list(tensor.shape)} in the destination"
            )


def _names(names: list[str]) -> str:
    return preview_keys([repr(n) for n in names], limit=5)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} appears twice")
        result[key] = value
    return result
