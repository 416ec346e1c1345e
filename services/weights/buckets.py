"""How a direct transport cuts a stream's data into messages: buckets.

A piece of a large tensor is a bucket of its own, a view of the tensor's memory on both ends (no
copy); the pieces of small tensors share buckets, copied through a buffer, so that an adapter of
hundreds of small tensors travels in a few messages rather than one per tensor (one message per
tensor ran a 56 MB adapter of 448 tensors over UCX at half the speed of one tensor). Sender and
receiver compute the same plan from the same lengths, so bucket ``k`` on one side is bucket ``k``
on the other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence

COALESCE_BELOW = 1 << 20
"""Pieces smaller than this (or than half a bucket) share buckets, copied through a buffer."""


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
