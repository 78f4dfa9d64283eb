"""Process-wide counters for compilation and graph events.

Tests read them to prove what happened (compiled vs loaded from cache), and /metrics and
/status export them. Names in use (docs/architecture.md): graphs_compiled, pieces,
pieces_compiled, artifacts_saved, artifacts_loaded, cache_hits, cache_misses, cache_corrupt (an
entry found unusable: missing, truncated or failing its checksum; compiled again), graphs_recorded,
graph_replays, eager_region_runs; each forward by the kind its StepPlan named: eager_steps,
req_graph_replays, token_graph_replays; speculative decoding: verify_graph_replays,
draft_graph_replays, spec_verify_steps.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class CounterRegistry:
    """A thread-safe name -> int registry; unknown names read as 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: Counter[str] = Counter()

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._values.get(name, 0)

    def __getitem__(self, name: str) -> int:
        return self.get(name)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            self._values.clear()

    def delta(self, before: dict[str, int]) -> dict[str, int]:
        """Non-zero changes since `before` (a snapshot())."""
        now = self.snapshot()
        names = set(now) | set(before)
        return {k: now.get(k, 0) - before.get(k, 0) for k in names if now.get(k, 0) != before.get(k, 0)}

    @contextmanager
    def track(self) -> Iterator[dict[str, int]]:
        """`with counters.track() as d:` fills d with the deltas of the block on exit."""
        before = self.snapshot()
        result: dict[str, int] = {}
        try:
            yield result
        finally:
            result.update(self.delta(before))


counters = CounterRegistry()
