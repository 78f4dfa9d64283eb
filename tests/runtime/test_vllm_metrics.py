"""Issue 46, item 1: /metrics also speaks vLLM's series (docs/metrics.md), read with
prometheus_client's parser under scripted load.

One in-process server on the tiny CPU engine, whose steps the test gates (`Gate`): while it
holds, the engine core keeps answering scrapes and nothing moves, so each scrape is compared
with what the engine holds at that moment (its scheduler's queues, its block pool). Then one
real two-API-server process: the engine's series appear once, the request series are summed,
never doubled. Reproduce by hand: `atom-runtime serve --model tiny-llama --load-format dummy
--max-num-seqs 2`, send 5 long completions, and `curl :PORT/metrics | grep ^vllm:`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from server_proc import Proc, healthy_server
from tiny import tiny_config

from atom.config import Config
from atom.engine import LLMEngine
from atom.engine.params import RequestOutput
from atom.entrypoints.api_server import serve
from atom.entrypoints.core.client import ThreadCore
from atom.entrypoints.metrics_vllm import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from atom.entrypoints.state import ServerState
from atom.models.registry import load_model_config
from atom.tokenizer import load_tokenizer
from atom_devtools.localprocs import free_port
from testutil import wait_for

MODEL = "tiny-llama"
MAX_NUM_SEQS = 2
REQUESTS = 5
MAX_TOKENS = 40
PROMPT = "metrics " * 4  # a few dozen tokens: two or three KV blocks each


class Gate(LLMEngine):
    """The tiny LLMEngine, whose step() runs only while the test allows: held, it returns no
    outputs, so the core's loop goes on (draining input, answering scrapes) and the engine's
    state stays as the last real step left it."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.budget: int | None = None  # steps still allowed; None: free running
        self.steps = 0  # real steps taken
        self.lock = threading.Lock()

    def hold(self) -> None:
        with self.lock:
            self.budget = 0

    def allow(self, n: int) -> int:
        """n more real steps; the step count to wait for."""
        with self.lock:
            self.budget = n
            return self.steps + n

    def run(self) -> None:
        with self.lock:
            self.budget = None

    def step(self) -> list[RequestOutput]:
        with self.lock:
            held = self.budget == 0
            if not held and self.budget is not None:
                self.budget -= 1
        if held:
            time.sleep(0.001)
            return []
        outs = super().step()
        self.steps += 1
        return outs


@dataclass
class Served:
    url: str
    config: Config
    gate: Gate


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The API server and a ThreadCore on the gated tiny engine, in a thread of their own."""
    config = tiny_config(
        max_num_seqs=MAX_NUM_SEQS, num_kv_blocks=64, max_model_len=256, served_model_name=MODEL
    )
    gate = Gate(config)
    port = free_port()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    state = ServerState(engine=ThreadCore(lambda: gate), served_model_name=MODEL, model=MODEL,
                        config=config)  # fmt: skip
    model_cfg = load_model_config(MODEL)
    state.tokenizer = load_tokenizer(MODEL, model_cfg.vocab_size, None, model_cfg.eos_token_id)
    state.vocab_size = model_cfg.vocab_size

    async def main() -> None:
        await serve(state, "127.0.0.1", port, grace_s=2.0, stop=stop, install_signals=False)

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_for("the server's /health", lambda: httpx.get(url + "/health").status_code == 200,
             timeout=60, interval=0.1)  # fmt: skip
    try:
        yield Served(url, config, gate)
    finally:
        gate.run()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)


Series = dict[str, list[Sample]]


def scrape(url: str) -> tuple[Series, dict[str, str]]:
    """Samples by sample name, and each family's type (by family name)."""
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200, r.text
    samples: Series = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, []).append(s)
    return samples, types


def one(samples: Series, name: str, **labels: str) -> float:
    """The value of the one sample of `name` with these labels (it must be exactly one)."""
    hits = [
        s for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0].value


def engine_view(samples: Series) -> tuple[float, float, float]:
    ident = {"model_name": MODEL, "engine": "0"}
    return (
        one(samples, "vllm:num_requests_waiting", **ident),
        one(samples, "vllm:num_requests_running", **ident),
        one(samples, "vllm:kv_cache_usage_perc", **ident),
    )


def held_state(gate: Gate) -> tuple[float, float, float]:
    """What the held engine holds (nothing moves it while held)."""
    bm = gate.block_manager
    return (len(gate.scheduler.waiting), len(gate.scheduler.running),
            bm.num_used_blocks / bm.num_blocks)  # fmt: skip


def request_totals(samples: Series) -> dict[str, float]:
    ident = {"model_name": MODEL, "engine": "0"}
    return {
        "prompt": one(samples, "vllm:prompt_tokens_total", **ident),
        "generation": one(samples, "vllm:generation_tokens_total", **ident),
        "length": one(samples, "vllm:request_success_total", finished_reason="length", **ident),
        "ttft": one(samples, "vllm:time_to_first_token_seconds_count", **ident),
        "itl": one(samples, "vllm:inter_token_latency_seconds_count", **ident),
        "e2e": one(samples, "vllm:e2e_request_latency_seconds_count", **ident),
    }


def complete(url: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_waiting_running_and_kv_usage_are_the_engines_at_each_scrape(served: Served) -> None:
    gate, url = served.gate, served.url
    before = request_totals(scrape(url)[0])
    gate.hold()
    pool = ThreadPoolExecutor(REQUESTS)
    try:
        futures = [pool.submit(complete, url, MAX_TOKENS) for _ in range(REQUESTS)]
        # All admitted, none stepped: every request waits, no block is taken.
        wait_for("the requests in the engine's queue",
                 lambda: len(gate.scheduler.waiting) == REQUESTS, timeout=30, interval=0.02)  # fmt: skip
        samples, _ = scrape(url)
        assert engine_view(samples) == held_state(gate) == (REQUESTS, 0, 0.0)
        # atom_* and vllm:* come from the same read of the engine
        assert one(samples, "atom_num_requests_waiting") == REQUESTS
        # One step: max_num_seqs run, the rest wait, their prompts hold blocks.
        target = gate.allow(1)
        wait_for("one engine step", lambda: gate.steps == target, timeout=30, interval=0.01)
        samples, _ = scrape(url)
        waiting, running, kv_first = engine_view(samples)
        assert (waiting, running, kv_first) == held_state(gate)
        assert (waiting, running) == (REQUESTS - MAX_NUM_SEQS, MAX_NUM_SEQS)
        assert kv_first > 0
        # Decoding past a block boundary takes more blocks; the gauge follows.
        target = gate.allow(MAX_TOKENS - 10)
        wait_for("more engine steps", lambda: gate.steps == target, timeout=60, interval=0.01)
        samples, _ = scrape(url)
        assert engine_view(samples) == held_state(gate)
        assert engine_view(samples)[2] > kv_first
        gate.run()
        usages = [f.result(timeout=120) for f in futures]
    finally:
        gate.run()
        pool.shutdown()
    # Done: nothing runs or waits; finished prompts stay cached but count as free (as vLLM).
    samples, _ = scrape(url)
    assert engine_view(samples) == held_state(gate) == (0, 0, 0.0)
    after = request_totals(samples)
    delta = {k: after[k] - before[k] for k in after}
    generated = sum(u["completion_tokens"] for u in usages)
    assert generated == REQUESTS * MAX_TOKENS
    assert delta == {
        "prompt": sum(u["prompt_tokens"] for u in usages),
        "generation": generated,
        "length": REQUESTS,
        "ttft": REQUESTS,  # every finished request in each histogram, each token once
        "itl": generated - REQUESTS,
        "e2e": REQUESTS,
    }


def test_series_names_types_labels_and_config_info(served: Served) -> None:
    complete(served.url, 3)
    samples, types = scrape(served.url)
    for name, kind in {
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_running": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:cache_config_info": "gauge",
        "vllm:lora_requests_info": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prefix_cache_queries": "counter",
        "vllm:prefix_cache_hits": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:request_success": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:e2e_request_latency_seconds": "histogram",
        "atom_num_requests_waiting": "gauge",  # ours stay
        "atom_time_to_first_token_seconds": "histogram",
    }.items():
        assert types.get(name) == kind, (name, types.get(name))
    # vLLM's buckets, with model_name and engine
    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                          ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
                          ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)):  # fmt: skip
        got = samples[name + "_bucket"]
        assert [s.labels["le"] for s in got] == [*map(str, buckets), "+Inf"]
        assert all(s.labels["model_name"] == MODEL and s.labels["engine"] == "0" for s in got)
    assert {s.labels["finished_reason"] for s in samples["vllm:request_success_total"]} == {
        "stop", "length", "abort", "error", "repetition"
    }  # fmt: skip
    (info,) = samples["vllm:cache_config_info"]
    assert info.value == 1.0
    cfg, bm = served.config, served.gate.block_manager
    assert info.labels["block_size"] == str(cfg.block_size) == str(bm.block_size)
    assert info.labels["num_gpu_blocks"] == str(bm.num_blocks) == "64"
    assert info.labels["enable_prefix_caching"] == str(cfg.enable_prefix_caching)
    assert info.labels["gpu_memory_utilization"] == str(cfg.gpu_memory_utilization)
    assert info.labels["engine"] == "0"
    (lora,) = samples["vllm:lora_requests_info"]
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "",
                           "waiting_lora_adapters": ""}  # fmt: skip
    assert abs(lora.value - time.time()) < 60  # vLLM: the time of its last update


@pytest.fixture(scope="module")
def two_servers() -> Iterator[Proc]:
    yield from healthy_server("--api-server-count", "2", "--max-num-seqs", str(MAX_NUM_SEQS))


def test_two_api_servers_report_the_engine_once_and_requests_summed(two_servers: Proc) -> None:
    url = two_servers.url
    wait_for("both API servers' first snapshot",
             lambda: all(f'atom_api_process_start_time_seconds{{api_server="{i}"}}'
                         in httpx.get(url + "/metrics").text for i in (0, 1)),
             timeout=30, interval=0.2)  # fmt: skip
    before = request_totals(scrape(url)[0])
    n = 2 * MAX_NUM_SEQS
    seen: list[tuple[float, float]] = []
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(complete, url, 120) for _ in range(n)]

        def full_batch() -> bool:
            waiting, running, _ = engine_view(scrape(url)[0])  # one sample each, whoever answers
            seen.append((waiting, running))
            return (waiting, running) == (n - MAX_NUM_SEQS, MAX_NUM_SEQS)

        wait_for("a scrape with a full batch and the rest waiting", full_batch, timeout=60,
                 interval=0.02)  # fmt: skip
        usages = [f.result(timeout=120) for f in futures]
    assert all(w <= n - MAX_NUM_SEQS and r <= MAX_NUM_SEQS for w, r in seen), seen  # never doubled
    want = {
        "prompt": before["prompt"] + sum(u["prompt_tokens"] for u in usages),
        "generation": before["generation"] + sum(u["completion_tokens"] for u in usages),
        "length": before["length"] + n,
        "e2e": before["e2e"] + n,
    }
    # Summed over both processes (a peer's snapshot is at most a push period old).
    wait_for("every request counted once, whichever process answers",
             lambda: all({k: request_totals(scrape(url)[0])[k] for k in want} == want
                         for _ in range(4)), timeout=10, interval=0.2)  # fmt: skip
