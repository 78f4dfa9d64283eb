"""The one CUDA-graph memory pool and the one capture stream every recording shares.

Recordings never replay concurrently and each one's output is consumed before the next
replays, so the pool is the largest recording's, not the sum. The state is one object per
process (`GRAPH_POOL`) rather than loose module globals, so a test can swap in its own.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch


class GraphPool:
    """Hands out the shared pool handle and counts the graphs recorded into it.

    Once every graph recorded into a pool is gone, the caching allocator no longer accepts
    captures into it (it asserts use_count > 0): a new pool is started then, e.g. when a
    re-capture drops the old recordings before recording new ones.
    """

    def __init__(self) -> None:
        self.handle: Any = None
        self.live = 0  # graphs recorded into handle that are still alive
        self.used = False
        self._stream: Any = None

    def get(self) -> Any:
        if self.handle is None or (self.used and self.live == 0):
            self.handle = torch.cuda.graph_pool_handle()
            self.live, self.used = 0, False
        return self.handle

    def track(self, graph: Any, pool: Any) -> None:
        """Count a graph holding the shared pool until it is garbage."""
        if pool != self.handle:
            return
        try:
            weakref.finalize(graph, self._untrack, pool)
        except TypeError:  # not weak-referenceable: keep the pool for the process's lifetime
            return
        self.live += 1
        self.used = True

    def _untrack(self, pool: Any) -> None:
        if pool == self.handle:
            self.live -= 1

    def capture_stream(self) -> Any:
        """One side stream for every recording: per-stream library workspaces (cuBLAS) are
        then allocated once, not once per recording."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream


GRAPH_POOL = GraphPool()


def graph_pool() -> Any:
    """The one memory pool every ReqGraph and TokenGraph records into."""
    return GRAPH_POOL.get()
