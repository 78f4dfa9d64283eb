"""Issue 48, items 4 and 5 with real processes on loopback (tiny dummy Llama, CPU): a stalled
engine core is taken out of rotation, and a decode instance with the wrong internal token never
gets into it.

One prefill, two decode instances and atom-router. The second decode was started with another
ATOM_INTERNAL_TOKEN: the router's probe learns that from its /health and keeps it out, with
the reason in the router's /status. The first decode runs with `--stall-timeout 2
--stream-stall-timeout 5`; its engine core gets SIGSTOP mid-stream: its /health turns 503
`engine_stalled`, the router takes it out, the open stream ends with an `engine_stalled` error
event, /livez stays 200 (liveness is --liveness-timeout's). After SIGCONT it comes back.
Reproduce: the same processes, `kill -STOP <core_pid from the decode's /status>` mid-stream.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
from server_proc import Proc, start_router, start_server

from atom.wire.trust import TOKEN_ENV

MODEL = "tiny-llama"
P_D = {TOKEN_ENV: "stall-token"}
STALL_S, STREAM_STALL_S = 2, 5


@dataclass
class Cluster:
    prefill: Proc
    decode: Proc
    wrong: Proc  # a decode with another token
    router: Proc


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    stall = ("--stall-timeout", str(STALL_S), "--stream-stall-timeout", str(STREAM_STALL_S))
    procs = [
        start_server("--role", "prefill", "--kv-port", "0", env=P_D),
        start_server("--role", "decode", *stall, env=P_D),
        start_server("--role", "decode", env={TOKEN_ENV: "another-token"}),
    ]
    router = None
    try:
        for p in procs:
            p.wait_healthy()
        router = start_router(
            [procs[0].url], [procs[1].url, procs[2].url],
            "--health-interval", "0.3", "--queue-timeout", "1",
            env=P_D,
        )  # fmt: skip
        router.wait_healthy()
        yield Cluster(*procs, router)
    finally:
        for p in (router, *procs):
            if p is not None:
                p.stop()


def wait_for(what: str, ok: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def decode_entry(c: Cluster, proc: Proc) -> dict:
    status = httpx.get(c.router.url + "/status", timeout=10).json()
    return next(i for i in status["instances"]["decode"] if i["url"] == proc.url)


def complete(c: Cluster, i: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": f"hello {i}", "max_tokens": 3, "ignore_eos": True}
    return httpx.post(c.router.url + "/v1/completions", json=body, timeout=60)


def test_a_decode_with_another_token_stays_out_of_rotation(cluster: Cluster) -> None:
    wait_for("the probe's verdict", lambda: decode_entry(cluster, cluster.wrong)["healthy"] is False)
    entry = decode_entry(cluster, cluster.wrong)
    assert "internal token mismatch" in entry["reason"], entry
    assert decode_entry(cluster, cluster.decode)["healthy"] is True
    for i in range(4):  # all go to the good decode, none fails with a 403
        r = complete(cluster, i)
        assert r.status_code == 200, r.text
    assert httpx.get(cluster.wrong.url + "/metrics").text.count('atom_requests_total{') == 0


def test_a_stalled_core_leaves_rotation_and_its_streams_end_with_an_error(cluster: Cluster) -> None:
    core = httpx.get(cluster.decode.url + "/status").json()["core_pid"]
    body = {"model": MODEL, "prompt": "stream", "max_tokens": 1500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    events: list[str] = []
    stopped_at = 0.0
    try:
        with httpx.stream("POST", cluster.router.url + "/v1/completions", json=body,
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if len(events) == 3 and not stopped_at:
                    os.kill(core, signal.SIGSTOP)
                    stopped_at = time.monotonic()
        ended = time.monotonic() - stopped_at
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_stalled", err
        assert STREAM_STALL_S <= ended < STREAM_STALL_S + 10
        health = httpx.get(cluster.decode.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine_stalled"
        assert health.headers["Retry-After"] == "1"
        assert httpx.get(cluster.decode.url + "/livez").status_code == 200  # alive, not ready
        wait_for("the router to take it out",
                 lambda: decode_entry(cluster, cluster.decode)["healthy"] is False)  # fmt: skip
        assert "engine" in decode_entry(cluster, cluster.decode)["reason"]
        # no decode in rotation now: a clear 503, no instance address, Retry-After
        r = complete(cluster, 99)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "no_backend"
        assert "127.0.0.1" not in r.text and "http://" not in r.text, r.text
    finally:
        os.kill(core, signal.SIGCONT)
    wait_for("the decode back in rotation",
             lambda: decode_entry(cluster, cluster.decode)["healthy"] is True)  # fmt: skip
    assert complete(cluster, 100).status_code == 200
