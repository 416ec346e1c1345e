"""A state dict as a safetensors byte stream, sent and received without a copy of the whole file.

An adapter is small enough to travel as one ``bytes`` object; a whole model is not, and no
transport assembles one. :class:`EncodedStream` describes a state dict as the bytes of a
safetensors file without assembling them: the header, then each tensor's own memory viewed as
bytes. :class:`StreamDecoder` is the other end: it parses the header, allocates the tensors (or,
given ``destination``, checks and reuses tensors that exist already, such as a model's own
parameters) and hands the transport writable views of their memory to receive into, or takes
the stream piece by piece as it comes (:meth:`StreamDecoder.feed`, the object store's chunks).
The digest of the whole file as in ``WeightsReady.digest`` (:mod:`services.weights.digest`) is
computed once on each side over the same views, and checked in :meth:`StreamDecoder.finish`.

The layout is standard safetensors, so :meth:`EncodedStream.to_bytes` is a file that
``safetensors.torch.load`` reads: an 8-byte little-endian header length, a JSON header mapping
each tensor name to its ``dtype``, ``shape`` and ``data_offsets`` (plus ``__metadata__``,
``{"format": "pt"}``), padded with spaces to a multiple of 8 bytes, then the tensors' bytes, one
after the other in the order of their (sorted) names. :mod:`services.weights.header` parses
and checks the header.

A direct transport moves the data part as :func:`services.weights.buckets.bucket_plan` cuts it;
a file is read as :func:`split` cuts it: each tensor's bytes in pieces of at most
``chunk_bytes``, a piece never spanning two tensors (so it is a view, not a copy).
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from services.weights import digest as digests
from services.weights.errors import WeightsError
from services.weights.header import (
    CODES,
    MAX_HEADER_BYTES,
    METADATA,
    Entry,
    check_fits,
    parse_header,
)

CHUNK_BYTES = 8 << 20
"""Default piece size: large enough that per-message costs vanish, small enough to pipeline."""


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
        self.digest = digests.digest_of(self.segments())

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Tensor]) -> EncodedStream:
        """Encode ``state``: each tensor made contiguous and CPU (no copy when it is already)."""
        if not state:
            raise ValueError("refusing to encode a state dict with no tensors")
        tensors: list[tuple[str, Tensor]] = []
        entries: dict[str, Any] = {METADATA: {"format": "pt"}}
        offset = 0
        for name in sorted(state):
            if not isinstance(name, str) or not name or name == METADATA:
                raise ValueError(f"cannot encode a tensor named {name!r}")
            tensor = state[name].detach().to("cpu").resolve_conj().resolve_neg().contiguous()
            code = CODES.get(tensor.dtype)
            if code is None:
                raise ValueError(
                    f"cannot encode {name!r}: dtype {tensor.dtype} has no safetensors code "
                    f"here (supported: {', '.join(str(d) for d in CODES)})"
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

    def to_bytes(self) -> bytes:
        """The whole safetensors file in one ``bytes`` (for tests and small adapters)."""
        return b"".join(self.segments())


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
        # An algorithm this build cannot check is refused before anything lands.
        self.algorithm = digests.algorithm(where, digest)
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
        entries = parse_header(where, bytes(header[8:]))
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
        following it (BLAKE3 runs at about 4.4 GB/s on one core here; a transfer on loopback at
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
        """The received tensors, after checking the total size and the digest."""
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
            got = digests.digest_of([self._header, *self._views], self.algorithm)
        digests.verify(self.where, self.digest, got, received, touched=self.touched)
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
        hasher = digests.hasher(self.algorithm)  # one thread: the transfer needs the other core
        hasher.update(self._header)
        total = sum(len(v) for v in self._views)
        done = index = offset = 0  # bytes hashed; the view and the offset in it where they end
        while done < total:
            with self._progress:
                while not (self._abandoned or self._landed > done):
                    self._progress.wait()
                if self._abandoned:
                    return
                mark = min(self._landed, total)
            while done < mark:  # outside the lock; both hashers release the GIL on large updates
                view = self._views[index]
                take = min(len(view) - offset, mark - done)
                hasher.update(view[offset : offset + take])
                done += take
                offset += take
                if offset == len(view):
                    index, offset = index + 1, 0
        self._hashed = f"{self.algorithm}:{hasher.hexdigest()}"

    # --- inside feed_header -------------------------------------------------------------------

    def _target(self, entry: Entry) -> Tensor:
        """Where ``entry``'s bytes land: a fresh tensor; or the destination's own tensor
        (:func:`~services.weights.header.check_fits` has checked its dtype and shape) when it is a contiguous CPU tensor,
        else a CPU tensor staged for :meth:`finish` to copy into it."""
        if self.destination is None:
            return torch.empty(entry.shape, dtype=entry.dtype)
        tensor = self.destination[entry.name]
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            return tensor
        staged = torch.empty(entry.shape, dtype=entry.dtype)
        self._staged.append((tensor, staged))
        return staged
