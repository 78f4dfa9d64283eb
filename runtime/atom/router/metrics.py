"""The router's Prometheus metrics: per-backend outcomes, queue, outstanding requests per instance."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from atom.router.capacity import Capacity
from atom.router.pool import Pool

PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    def __init__(self, pools: list[Pool], rooms: list[Capacity] | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "atom_router_requests",
            "Proxied requests by role, backend and HTTP status",
            ["role", "backend", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "atom_router_backend_errors",
            "Backend failures (unreachable, dropped, timed out)",
            ["role", "backend"],
            registry=self.registry,
        )
        self.unavailable = Counter(
            "atom_router_unavailable",
            "Requests answered 503 by the router, by the side that failed",
            ["role"],
            registry=self.registry,
        )
        self.releases = Counter(
            "atom_router_kv_releases",
            "Prefill holds released after the decode side failed or the client left",
            ["outcome"],
            registry=self.registry,
        )
        self.responses = Counter(
            "atom_router_http_responses",
            "Responses of the router by HTTP status (every route, errors included)",
            ["status"],
            registry=self.registry,
        )
        self.prefill_seconds = Histogram(
            "atom_router_prefill_seconds",
            "Duration of the prefill call (prompt + first token + KV handle)",
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.first_byte_seconds = Histogram(
            "atom_router_time_to_first_byte_seconds",
            "Request arrival to the first byte of the decode answer",
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.queue = Gauge(
            "atom_router_queue_depth",
            "Requests waiting for an instance to come into rotation",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "atom_router_requests_in_flight", "Requests inside the router", registry=self.registry
        )
        self.registry.register(_PoolCollector(pools, rooms or []))


class _PoolCollector(Collector):
    def __init__(self, pools: list[Pool], rooms: list[Capacity]) -> None:
        self._pools, self._rooms = pools, rooms

    def collect(self) -> Iterator[Any]:
        outstanding = GaugeMetricFamily(
            "atom_router_outstanding_requests",
            "Requests in flight per instance",
            labels=["role", "instance"],
        )
        healthy = GaugeMetricFamily(
            "atom_router_instance_healthy",
            "1 if the instance is in rotation",
            labels=["role", "instance"],
        )
        for pool in self._pools:
            for inst in list(pool.instances.values()):
                outstanding.add_metric([pool.role, inst.url], inst.outstanding)
                healthy.add_metric([pool.role, inst.url], 1.0 if inst.in_rotation else 0.0)
        yield outstanding
        yield healthy
        waiting = GaugeMetricFamily(
            "atom_router_waiting_for_room",
            "Requests held while every instance of the role is busy (hold cap, queue bound)",
            labels=["role"],
        )
        for room in self._rooms:
            waiting.add_metric([room.role], room.waiting)
        yield waiting
