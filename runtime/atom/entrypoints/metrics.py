"""Prometheus metrics: request outcomes and latencies observed by the API server; the engine's
gauges and compile/graph counters, which the engine core renders itself at scrape time (read
over the IPC with its own series, the KV transfers, and appended); and the vLLM-compatible
`vllm:*` view of both (atom.entrypoints.metrics_vllm). docs/metrics.md lists every series. One
registry per server, so tests can build several apps in one process."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from atom.entrypoints.metrics_vllm import (
    E2E,
    ENGINE_INDEX,
    ITL,
    LABELS,
    NO_LORA,
    TTFT,
    HistogramSpec,
    LoraState,
    RequestSeries,
    VllmEngineInfo,
    engine_families,
)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)

# engine.stats() keys exported as gauges (name -> help)
ENGINE_GAUGES = {
    "running": ("atom_num_requests_running", "Sequences in the running batch"),
    "waiting": ("atom_num_requests_waiting", "Sequences waiting to be scheduled"),
    "kv_blocks_used": ("atom_kv_blocks_used", "Paged KV cache blocks in use"),
    "kv_blocks_total": ("atom_kv_blocks_total", "Paged KV cache blocks in total"),
    "num_preemptions": ("atom_num_preemptions", "Sequences preempted (recomputed) so far"),
    "kv_blocks_cached": (
        "atom_kv_blocks_cached",
        "KV blocks with a prefix-cache key (in use or kept for reuse)",
    ),
    "kv_blocks_cached_idle": (
        "atom_kv_blocks_cached_idle",
        "Cached KV blocks no sequence uses (evicted LRU when the pool needs them)",
    ),
}

# engine.stats() keys exported as counters (atom_<name>_total): prefix caching, in prompt tokens
# and requests, counted once per request at its first admission.
ENGINE_COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "prefix_cache_hits": "Prompt tokens whose KV came from the prefix cache",
    "prefix_cache_requests": "Requests looked up in the prefix cache",
    "prefix_cache_requests_hit": "Requests with at least one cached block",
    "prefix_cache_evicted_blocks": "Cached KV blocks evicted to make room",
}

# atom.utils.counters names (docs/architecture.md): exported even before they first move.
DOCUMENTED_COUNTERS = (
    "graphs_compiled",
    "pieces",
    "pieces_compiled",
    "artifacts_saved",
    "artifacts_loaded",
    "artifacts_reused",
    "cache_hits",
    "cache_misses",
    "dynamo_traces_saved",
    "dynamo_traces_loaded",
    "graphs_recorded",
    "graph_replays",
    "eager_steps",
    "eager_region_runs",
    "verify_graph_replays",
    "draft_graph_replays",
)

# Speculative decoding (LLMEngine.stats(), atom.spec_decode.decoder.SpecStats): present only
# when --speculative-config is on. Totals -> counters, ratios -> gauges.
SPEC_COUNTERS = {
    "spec_decode_num_draft_tokens": ("atom_spec_decode_num_draft_tokens", "Draft tokens proposed"),
    "spec_decode_num_accepted_tokens": (
        "atom_spec_decode_num_accepted_tokens",
        "Draft tokens accepted",
    ),
    "spec_decode_num_drafts": (
        "atom_spec_decode_num_drafts",
        "Requests verified, summed over steps",
    ),
    "spec_decode_num_emitted_tokens": (
        "atom_spec_decode_num_emitted_tokens",
        "Tokens emitted by verify steps",
    ),
    "spec_decode_no_draft_steps": (
        "atom_spec_decode_no_draft_steps",
        "Decode steps run without verification: the drafter proposed nothing",
    ),
}
SPEC_GAUGES = {
    "spec_decode_acceptance_rate": (
        "atom_spec_decode_acceptance_rate",
        "Accepted / drafted tokens",
    ),
    "spec_decode_mean_accepted_tokens": (
        "atom_spec_decode_mean_accepted_tokens",
        "Tokens a request gains per verify step (1 + accepted drafts)",
    ),
}


class _Buckets:
    """Counts per bucket (the last: above every bound, +Inf), cumulated when rendered."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.upper = [float(b) for b in buckets]
        self.counts = [0] * (len(self.upper) + 1)

    def cumulative(self) -> list[tuple[str, float]]:
        cum = 0
        out: list[tuple[str, float]] = []
        for bound, count in zip([*self.upper, float("inf")], self.counts, strict=True):
            cum += count
            out.append((floatToGoString(bound), cum))
        return out


class FastHistogram(Collector):
    """A histogram whose observe() is a bisect and two additions: called once per request
    per step on the serving path, where prometheus_client's lock and bucket walk add up.
    With `vllm`, the same observations also render as vLLM's series (its name, buckets and
    model_name/engine labels): one more bisect."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float],
                 registry: CollectorRegistry, vllm: HistogramSpec | None = None,
                 model_name: str = "") -> None:  # fmt: skip
        self.name, self.doc = name, doc
        self._own = _Buckets(buckets)
        self._vllm = vllm
        self._mirror = _Buckets(vllm.buckets) if vllm is not None else None
        self._labels = [model_name, ENGINE_INDEX]
        self._sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        own = self._own
        own.counts[bisect_left(own.upper, value)] += 1
        if self._mirror is not None:
            self._mirror.counts[bisect_left(self._mirror.upper, value)] += 1
        self._sum += value

    def observe_n(self, value: float, n: int) -> None:
        """n observations of the same value (tokens that came in one chunk)."""
        own = self._own
        own.counts[bisect_left(own.upper, value)] += n
        if self._mirror is not None:
            self._mirror.counts[bisect_left(self._mirror.upper, value)] += n
        self._sum += value * n

    @property
    def count(self) -> int:
        return sum(self._own.counts)

    def collect(self) -> Iterator[Any]:
        yield HistogramMetricFamily(
            self.name, self.doc, buckets=self._own.cumulative(), sum_value=self._sum
        )
        if self._vllm is not None and self._mirror is not None:
            fam = HistogramMetricFamily(self._vllm.name, self._vllm.doc, labels=LABELS)
            fam.add_metric(self._labels, self._mirror.cumulative(), sum_value=self._sum)
            yield fam


class ServerMetrics:
    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        counters: Callable[[], dict[str, int]],
        warmup: Callable[[], dict[str, Any]],
        model_name: str = "",
    ) -> None:
        self.registry = CollectorRegistry()
        # received = sum(atom_requests_total) + sum(atom_requests_failed_total), once the
        # requests in flight have ended.
        self.received = Counter(
            "atom_requests_received",
            "Generation requests received (each ends in atom_requests or atom_requests_failed)",
            registry=self.registry,
        )
        self.requests = Counter(
            "atom_requests",
            "Requests that finished (stop, length) or were aborted (client gone), by endpoint",
            ["endpoint", "finish_reason"],
            registry=self.registry,
        )
        self.failed = Counter(
            "atom_requests_failed",
            "Generation requests answered with an error (before or after the 200), by status",
            ["status"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "atom_requests_rejected",
            "Requests refused before reaching the engine",
            ["status"],
            registry=self.registry,
        )
        self.responses = Counter(
            "atom_http_responses",
            "HTTP responses by status code (every route, errors included)",
            ["status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "atom_prompt_tokens", "Prompt tokens of admitted requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "atom_generation_tokens", "Generated tokens", registry=self.registry
        )
        self.ttft = FastHistogram(
            "atom_time_to_first_token_seconds",
            "Arrival to first token",
            LATENCY_BUCKETS,
            self.registry,
            vllm=TTFT,
            model_name=model_name,
        )
        self.itl = FastHistogram(
            "atom_inter_token_latency_seconds",
            "Time between a request's successive tokens",
            LATENCY_BUCKETS,
            self.registry,
            vllm=ITL,
            model_name=model_name,
        )
        self.e2e = FastHistogram(
            "atom_e2e_request_latency_seconds",
            "Arrival to last token",
            LATENCY_BUCKETS,
            self.registry,
            vllm=E2E,
            model_name=model_name,
        )
        # vllm:prompt_tokens, vllm:generation_tokens (every token as it reaches its stream: the
        # first in ttft, the rest in itl) and vllm:request_success, at collect time.
        self.registry.register(RequestSeries(
            model_name, self.prompt_tokens, self.requests, lambda: self.ttft.count + self.itl.count
        ))  # fmt: skip
        # This process' memory and CPU (the engine core exports atom_core_process_*).
        ProcessCollector(namespace="atom_api", registry=self.registry)
        # The engine's series from its last Stats: only when the core does not answer a scrape
        # (the core renders them itself, read at that moment), so out of `registry`, this
        # process' own series (metrics_merge).
        self.engine_registry = CollectorRegistry()
        self.engine_registry.register(EngineCollector(stats, counters, warmup))

    def render(self, core: bytes | None = None) -> bytes:
        """This process' series and the core's answer to a scrape (its series and the
        engine's); without one, the engine's series from its last Stats."""
        own = generate_latest(self.registry)
        return own + (core if core is not None else generate_latest(self.engine_registry))


class EngineCollector(Collector):
    """Reads the engine's gauges and the process-wide counters at scrape time; with `vllm`
    (the core, once its engine is built) also their vllm:* view, from the same read."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        counters: Callable[[], dict[str, int]],
        warmup: Callable[[], dict[str, Any]],
        vllm: Callable[[], VllmEngineInfo | None] = lambda: None,
        lora: Callable[[], LoraState] = lambda: NO_LORA,
    ) -> None:
        self._stats, self._counters, self._warmup = stats, counters, warmup
        self._vllm, self._lora = vllm, lora

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        info = self._vllm()
        if info is not None:
            yield from engine_families(info, stats, self._lora())
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0) or 0))
        for key, doc in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"atom_{key}", doc, value=float(stats.get(key, 0) or 0))
        if "spec_decode_num_draft_tokens" in stats:
            for key, (name, doc) in SPEC_COUNTERS.items():
                yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0) or 0))
            for key, (name, doc) in SPEC_GAUGES.items():
                yield GaugeMetricFamily(name, doc, value=float(stats.get(key, 0) or 0))
        # Compile and graph counters: atom_<name>_total, e.g. atom_graph_replays_total.
        merged: dict[str, int] = dict.fromkeys(DOCUMENTED_COUNTERS, 0)  # always present, even at 0
        for source in (stats.get("counters"), self._counters()):
            if isinstance(source, dict):
                merged.update({k: int(v) for k, v in source.items() if isinstance(v, (int, float))})
        for name in sorted(merged):
            yield CounterMetricFamily(
                f"atom_{name}", f"atom.utils.counters[{name!r}]", value=merged[name]
            )
        summary = self._warmup()
        yield GaugeMetricFamily(
            "atom_capture_seconds",
            "Seconds spent capturing CUDA graphs at warm-up",
            value=float(_capture_seconds(summary)),
        )
        yield GaugeMetricFamily(
            "atom_compile_seconds",
            "Seconds spent compiling at warm-up",
            value=float(summary.get("compile_seconds", 0) or 0),
        )
        yield GaugeMetricFamily(
            "atom_captured_buckets",
            "CUDA graph buckets captured",
            value=float(len(captured_buckets(summary))),
        )


def _capture_seconds(summary: dict[str, Any]) -> float:
    for key in ("capture_seconds", "capture_time_s", "capture_time"):
        if isinstance(summary.get(key), (int, float)):
            return float(summary[key])
    return 0.0


def captured_buckets(summary: dict[str, Any]) -> list[Any]:
    for key in ("captured_sizes", "captured_buckets", "buckets"):
        value = summary.get(key)
        if isinstance(value, dict):  # per phase: {"decode": [...], "prefill": [...]}
            return sorted({b for v in value.values() for b in v})
        if isinstance(value, list):
            return value
    return []
