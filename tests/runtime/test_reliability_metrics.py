"""Issue 48, item 3: one consistent /metrics with `--api-server-count 2` (real processes, CPU).

Each scrape lands on either API server (SO_REUSEPORT); each answers with the series of both,
summed (atom.entrypoints.metrics_merge), so no counter goes down from one scrape to the next
while requests run. Reproduce: `atom-runtime serve --model tiny-llama --load-format dummy
--api-server-count 2 --port P`, load it, and scrape /metrics on fresh connections.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Proc, healthy_server

from testutil import wait_for

MODEL = "tiny-llama"
SCRAPES = 50
MONOTONIC = ("counter", "histogram")


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    yield from healthy_server("--api-server-count", "2", "--max-num-seqs", "16")


def load(url: str, stop: threading.Event) -> None:
    with httpx.Client(timeout=60) as c:
        i = 0
        while not stop.is_set():
            body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": 4, "ignore_eos": True}
            c.post(url + "/v1/completions", json=body)
            i += 1


def counters(text: str) -> dict[tuple, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        if fam.type in MONOTONIC
        for s in fam.samples
        if not s.name.endswith("_created")
    }


def both_processes_reported(url: str) -> bool:
    text = httpx.get(url + "/metrics", timeout=10).text
    return all(f'atom_api_process_start_time_seconds{{api_server="{i}"}}' in text for i in (0, 1))


def test_counters_never_decrease_across_scrapes_of_either_process(server: Proc) -> None:
    # Each API server pushes its first snapshot within a push period of starting, which may
    # come after /health is ready: the claim is about the steady state, from then on.
    wait_for("both API servers' first snapshot", lambda: both_processes_reported(server.url),
             timeout=30, interval=0.2)
    stop = threading.Event()
    loaders = [threading.Thread(target=load, args=(server.url, stop)) for _ in range(4)]
    for t in loaders:
        t.start()
    seen: list[dict[tuple, float]] = []
    pids: set[str] = set()
    try:
        for _ in range(SCRAPES):
            r = httpx.get(server.url + "/metrics", timeout=10)  # a new connection each time
            assert r.status_code == 200, r.text
            pids.add(r.headers["X-Atom-Api-Pid"])
            text = r.text
            # every scrape has both processes' own gauges, labelled
            assert 'atom_api_process_start_time_seconds{api_server="0"}' in text
            assert 'atom_api_process_start_time_seconds{api_server="1"}' in text
            seen.append(counters(text))
    finally:
        stop.set()
        for t in loaders:
            t.join(60)
    assert len(pids) == 2, "every scrape reached the same API server"
    for before, after in zip(seen, seen[1:], strict=False):
        down = {k: (v, after[k]) for k, v in before.items() if k in after and after[k] < v}
        assert not down, down
    first, last = seen[0], seen[-1]
    key = ("atom_requests_received_total", ())
    assert last[key] > first[key]  # the load moved the counters meanwhile
