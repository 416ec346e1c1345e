"""Decode steps captured as CUDA graphs, one per batch-size bucket.

A decode step of plexrl's engine reads and writes only buffers at fixed addresses (the decode
state, the paged cache, the stacked adapters) and makes no host synchronisation, so after one
eager run (the warm-up: kernels compiled, workspaces allocated) it is captured once per key and
then replayed: a single launch instead of the ~1,500 kernel launches a 16-layer step makes.
Keys are the batch bucket (the rows a step computes, rounded up to a power of two, so a batch
that shrinks or grows by a few sequences reuses a graph) plus whatever else changes the step's
shapes or code path. All graphs share one memory pool (their temporaries are never live at the
same time). A change of the buffers' addresses (:meth:`clear`) drops every graph.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def bucket_for(rows: int, max_rows: int) -> int:
    """The smallest bucket that holds ``rows``, at most ``max_rows``."""
    for bucket in BUCKETS:
        if bucket >= rows:
            return min(bucket, max_rows)
    return max_rows


class DecodeGraphs:
    """Run ``step(key)`` eagerly the first time a key is seen, captured and replayed after."""

    def __init__(self, step: Callable[[Hashable], None], enabled: bool) -> None:
        self._step = step
        self.enabled = enabled
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None
        self.num_captures = 0
        self.num_replays = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, key: Hashable) -> None:
        if not self.enabled:
            self._step(key)
            return
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            self.num_replays += 1
            return
        # The warm-up is a real step, run on a side stream as capture wants; the capture that
        # follows records without executing, so the state advances exactly once.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._step(key)
        self._pool = graph.pool()
        self._graphs[key] = graph
        self.num_captures += 1

    def clear(self) -> None:
        self._graphs.clear()
