"""Prometheus metrics of KV transfers, registered into a server's registry.

`direction` is "sent" on the prefill instance and "received" on the decode instance.
`atom_kv_transport_transfers{direction, transport, outcome}` counts transfers by the transport
they used: ok, fallback (this fast transport was refused or failed; TCP carried the blocks),
failed, refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TRANSFER_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class KVMetrics:
    def __init__(self, registry: CollectorRegistry, holds: Callable[[], Any] | None = None) -> None:
        self.bytes = Counter(
            "atom_kv_transfer_bytes", "KV cache bytes transferred", ["direction"], registry=registry
        )
        self.blocks = Counter(
            "atom_kv_transfer_blocks",
            "KV cache blocks transferred",
            ["direction"],
            registry=registry,
        )
        self.seconds = Histogram(
            "atom_kv_transfer_seconds",
            "Duration of one KV transfer (connect to last byte acknowledged)",
            ["direction"],
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self.transfers = Counter(
            "atom_kv_transfers",
            "KV transfers by outcome (ok, retried, failed, refused)",
            ["direction", "outcome"],
            registry=registry,
        )
        self.by_transport = Counter(
            "atom_kv_transport_transfers",
            "KV transfers by transport and outcome (ok, fallback, failed, refused)",
            ["direction", "transport", "outcome"],
            registry=registry,
        )
        self.transport_seconds = Histogram(
            "atom_kv_transport_seconds",
            "Duration of one KV transfer by the transport that carried it",
            ["direction", "transport"],
            buckets=TRANSFER_BUCKETS,
            registry=registry,
        )
        self._handles: Callable[[], Mapping[str, Any]] | None = None
        if holds is not None:
            registry.register(_HoldCollector(holds))
        registry.register(_HandleCollector(lambda: self._handles() if self._handles else {}))

    def watch_handles(self, handles: Callable[[], Mapping[str, Any]]) -> None:
        """handles: transport name -> its HandleCounters (read at scrape time)."""
        self._handles = handles

    def transport_outcome(
        self, direction: str, transport: str, outcome: str, seconds: float | None = None
    ) -> None:
        self.by_transport.labels(direction, transport, outcome).inc()
        if seconds is not None:
            self.transport_seconds.labels(direction, transport).observe(seconds)

    def observe(self, direction: str, nbytes: int, nblocks: int, seconds: float) -> None:
        self.bytes.labels(direction).inc(nbytes)
        self.blocks.labels(direction).inc(nblocks)
        self.seconds.labels(direction).observe(seconds)

    def outcome(self, direction: str, outcome: str) -> None:
        self.transfers.labels(direction, outcome).inc()


class _HoldCollector(Collector):
    """Blocks held for pulls, read at scrape time from the engine's hold registry."""

    def __init__(self, holds: Callable[[], Any]) -> None:
        self._holds = holds

    def collect(self) -> Iterator[Any]:
        reg = self._holds()
        held = reg.num_blocks_held if reg is not None else 0
        holds = reg.num_holds if reg is not None else 0
        expired = reg.stats.expired if reg is not None else 0
        yield GaugeMetricFamily("atom_kv_blocks_held", "KV blocks held for a pull", value=held)
        yield GaugeMetricFamily("atom_kv_holds", "Prefilled requests awaiting a pull", value=holds)
        yield CounterMetricFamily(
            "atom_kv_holds_expired", "Holds freed because nobody pulled them in time", value=expired
        )


@runtime_checkable
class TransportMetrics(Protocol):
    def transport_outcome(
        self, direction: str, transport: str, outcome: str, seconds: float | None = None
    ) -> None: ...


def count_transport(
    metrics: Any, direction: str, transport: str, outcome: str, seconds: float | None = None
) -> None:
    """Record on metrics that count transports (KVMetrics); others (tests' fakes) skip it."""
    if isinstance(metrics, TransportMetrics):
        metrics.transport_outcome(direction, transport, outcome, seconds)


class _HandleCollector(Collector):
    """Fast-transport handles (IPC mappings, NCCL groups) open now, and ever opened."""

    def __init__(self, handles: Callable[[], Mapping[str, Any]]) -> None:
        self._handles = handles

    def collect(self) -> Iterator[Any]:
        open_now = GaugeMetricFamily(
            "atom_kv_transport_handles_open", "Fast KV transport handles open", labels=["transport"]
        )
        opened = CounterMetricFamily(
            "atom_kv_transport_handles_opened", "Fast KV transport handles opened",
            labels=["transport"],
        )  # fmt: skip
        for name, counters in self._handles().items():
            open_now.add_metric([name], counters.open)
            opened.add_metric([name], counters.opened)
        yield open_now
        yield opened
