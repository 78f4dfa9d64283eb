"""The vLLM-compatible series (`vllm:*`): the names, types, labels and buckets vLLM's
PrometheusStatLogger (vllm/v1/metrics/loggers.py) exports, so what reads vLLM pods (llm-d's
and GIE's endpoint picker, KAITO's KEDA scaler, vLLM dashboards) reads ours. docs/metrics.md
maps each series to its source.

Two halves, like vLLM's: the engine's state (waiting, running, KV usage, cache config, LoRA),
rendered by the engine core at scrape time (`engine_families`), and the request series
(latency histograms, token and request counters), kept by each API server (`RequestSeries`,
and the histograms' vLLM view in metrics.FastHistogram) and summed over API servers by
metrics_merge like every other counter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

if TYPE_CHECKING:
    from atom.engine.api import EngineFacts

# One engine core per server: vLLM's engine index 0 (its `engine` label).
ENGINE_INDEX = "0"
LABELS = ["model_name", "engine"]

# vLLM's buckets, verbatim.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

# vLLM's FinishReason strings; vLLM creates every one at 0. Ours end in the first three.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


@dataclass(frozen=True)
class HistogramSpec:
    name: str
    doc: str
    buckets: tuple[float, ...]


TTFT = HistogramSpec(
    "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
    TTFT_BUCKETS,
)  # fmt: skip
ITL = HistogramSpec(
    "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
    ITL_BUCKETS,
)  # fmt: skip
E2E = HistogramSpec(
    "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
    REQUEST_LATENCY_BUCKETS,
)  # fmt: skip


@dataclass(frozen=True)
class LoraState:
    """vllm:lora_requests_info's labels: adapter names in the running batch and waiting, and
    --max-loras. Multi-LoRA serving fills it through EngineCore._lora_state; until then no
    adapter and max_lora 0."""

    max_lora: int = 0
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()


NO_LORA = LoraState()


@dataclass(frozen=True)
class CacheConfigInfo:
    """The vLLM CacheConfig fields we have an answer for (vllm:cache_config_info's labels;
    vLLM renders each value with str(), so booleans are "True"/"False" and unset is "None")."""

    block_size: int
    num_gpu_blocks: int  # the paged KV pool, in blocks (host memory on CPU)
    num_gpu_blocks_override: int | None  # --num-kv-blocks
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    cache_dtype: str = "auto"  # the KV cache is kept in the model's dtype

    def labels(self) -> dict[str, str]:
        return {
            "block_size": str(self.block_size),
            "cache_dtype": self.cache_dtype,
            "enable_prefix_caching": str(self.enable_prefix_caching),
            "gpu_memory_utilization": str(self.gpu_memory_utilization),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "num_gpu_blocks_override": str(self.num_gpu_blocks_override),
            "engine": ENGINE_INDEX,
        }


@dataclass(frozen=True)
class VllmEngineInfo:
    """What the engine core knows once its engine is built: the labels of its series."""

    model_name: str
    cache: CacheConfigInfo | None  # None: no Config to report (a test's scripted engine)

    @classmethod
    def from_facts(cls, facts: EngineFacts, num_blocks: int) -> VllmEngineInfo:
        config = facts.config
        if config is None:
            return cls(model_name="", cache=None)
        cache = CacheConfigInfo(
            block_size=config.block_size,
            num_gpu_blocks=num_blocks,
            num_gpu_blocks_override=config.num_kv_blocks,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enable_prefix_caching=config.enable_prefix_caching,
        )
        return cls(model_name=config.served_model_name or config.model, cache=cache)


def engine_families(
    info: VllmEngineInfo, stats: dict[str, Any], lora: LoraState
) -> Iterator[Metric]:
    """The engine's vllm:* series from one LLMEngine.stats() read (the core's, at scrape)."""
    values = [info.model_name, ENGINE_INDEX]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(name, doc, labels=LABELS)
        fam.add_metric(values, value)
        return fam

    def counter(name: str, doc: str, key: str) -> CounterMetricFamily:
        fam = CounterMetricFamily(name, doc, labels=LABELS)
        fam.add_metric(values, float(stats.get(key, 0) or 0))
        return fam

    yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                float(stats.get("running", 0) or 0))  # fmt: skip
    yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                float(stats.get("waiting", 0) or 0))  # fmt: skip
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                kv_usage(stats))  # fmt: skip
    yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                  "num_preemptions")  # fmt: skip
    yield counter("vllm:prefix_cache_queries",
                  "Prefix cache queries, in terms of number of queried tokens.",
                  "prefix_cache_queries")  # fmt: skip
    yield counter("vllm:prefix_cache_hits",
                  "Prefix cache hits, in terms of number of cached tokens.",
                  "prefix_cache_hits")  # fmt: skip
    if info.cache is not None:
        labels = info.cache.labels()
        fam = GaugeMetricFamily("vllm:cache_config_info",
                                "Information of the LLMEngine CacheConfig", labels=list(labels))  # fmt: skip
        fam.add_metric(list(labels.values()), 1.0)
        yield fam
    # vLLM sets it to the time of its last update (set_to_current_time); readers take the
    # sample with the latest value.
    fam = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])  # fmt: skip
    fam.add_metric([str(lora.max_lora), ",".join(lora.waiting), ",".join(lora.running)],
                   time.time())  # fmt: skip
    yield fam


def kv_usage(stats: dict[str, Any]) -> float:
    """Blocks some sequence (or a KV hold) uses over the pool, 0..1. Cached blocks nobody uses
    count as free, as in vLLM: the pool hands them out when it needs them."""
    total = int(stats.get("kv_blocks_total", 0) or 0)
    return int(stats.get("kv_blocks_used", 0) or 0) / total if total else 0.0


class RequestSeries(Collector):
    """The API server's vllm:* counters, read from its atom_* ones at collect time (nothing
    more on the serving path): tokens and finished requests."""

    def __init__(
        self,
        model_name: str,
        prompt_tokens: Counter,
        requests: Counter,
        tokens_out: Callable[[], int],
    ) -> None:
        self._values = [model_name, ENGINE_INDEX]
        self._prompt_tokens, self._requests, self._tokens_out = prompt_tokens, requests, tokens_out

    def collect(self) -> Iterator[Metric]:
        prompt = CounterMetricFamily(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels=LABELS
        )
        prompt.add_metric(self._values, _total(self._prompt_tokens))
        yield prompt
        gen = CounterMetricFamily(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels=LABELS
        )
        gen.add_metric(self._values, float(self._tokens_out()))
        yield gen
        by_reason = dict.fromkeys(FINISH_REASONS, 0.0)
        for sample in _samples(self._requests):  # atom_requests_total{endpoint, finish_reason}
            reason = sample.labels.get("finish_reason", "")
            by_reason[reason] = by_reason.get(reason, 0.0) + sample.value
        success = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=[*LABELS, "finished_reason"],
        )  # fmt: skip
        for reason, value in by_reason.items():
            success.add_metric([*self._values, reason], value)
        yield success


def _samples(counter: Counter) -> Iterator[Sample]:
    for fam in counter.collect():
        for sample in fam.samples:
            if sample.name.endswith("_total"):
                yield sample


def _total(counter: Counter) -> float:
    return sum(s.value for s in _samples(counter))
