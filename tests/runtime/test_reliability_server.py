"""Issue 48, items 2, 5 and 6 on one real server (tiny dummy Llama, CPU, loopback):
`--max-waiting 20` under a burst of 100, the carried-over defects, and a P/D role started
without ATOM_INTERNAL_TOKEN.

The burst is made deterministic by stopping the engine core (SIGSTOP) while it arrives: no
request produces a token, so exactly 20 are admitted and 80 get 429, then SIGCONT lets the 20
finish. (The temperature-below-1e-5 case is test_sampler.py's.) Reproduce by hand:
`atom-runtime serve --model tiny-llama --load-format dummy --max-waiting 20 --api-key K`,
`kill -STOP <core_pid from /status>`, send 100 requests at once, `kill -CONT`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import REPO, TINY_SERVER_ARGS, Proc, healthy_server

from atom.wire.trust import TOKEN_ENV

MODEL = "tiny-llama"
KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_WAITING = 20
BURST = 100


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    yield from healthy_server("--max-waiting", str(MAX_WAITING), "--api-key", KEY)


def status(proc: Proc) -> dict:
    return httpx.get(proc.url + "/status", headers=AUTH, timeout=10).json()


def metric(proc: Proc, name: str) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=10).text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def wait_for(what: str, ok, timeout_s: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def body(i: int, max_tokens: int = 2) -> dict:
    return {"model": MODEL, "prompt": f"req {i}", "max_tokens": max_tokens, "ignore_eos": True}


def test_a_burst_of_100_against_20_gets_exactly_80_429s(server: Proc) -> None:
    core = status(server)["core_pid"]

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=BURST + 5)
        async with httpx.AsyncClient(timeout=60, headers=AUTH, limits=limits) as c:
            os.kill(core, signal.SIGSTOP)
            try:
                tasks = [asyncio.create_task(c.post(server.url + "/v1/completions", json=body(i)))
                         for i in range(BURST)]  # fmt: skip
                # the refusals come back while the admitted ones wait on the stopped core
                while sum(t.done() for t in tasks) < BURST - MAX_WAITING:
                    await asyncio.sleep(0.05)
                assert status(server)["waiting_admitted"] == MAX_WAITING
            finally:
                os.kill(core, signal.SIGCONT)
            return list(await asyncio.gather(*tasks))

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    assert codes.count(429) == BURST - MAX_WAITING and codes.count(200) == MAX_WAITING, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
    wait_for("every slot given back", lambda: status(server)["waiting_admitted"] == 0)


def test_a_request_aborted_before_its_first_token_gives_its_slot_back(server: Proc) -> None:
    core = status(server)["core_pid"]

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as c:
            tasks = [asyncio.create_task(c.post(server.url + "/v1/completions", json=body(i)))
                     for i in range(5)]  # fmt: skip
            while status(server)["waiting_admitted"] < 5:
                await asyncio.sleep(0.05)
            for t in tasks:
                t.cancel()  # the clients hang up
            await asyncio.gather(*tasks, return_exceptions=True)

    os.kill(core, signal.SIGSTOP)
    try:
        asyncio.run(run())
        wait_for("the aborted requests' slots", lambda: status(server)["waiting_admitted"] == 0)
    finally:
        os.kill(core, signal.SIGCONT)


def test_aborted_requests_tokens_are_counted(server: Proc) -> None:
    before = metric(server, "atom_generation_tokens_total")
    aborts = metric(server, "atom_requests_total")
    received = 0
    stream = {**body(0, max_tokens=400), "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=stream, headers=AUTH) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                received += 1
                if received == 5:
                    break  # hang up mid-stream
    wait_for("the abort counted", lambda: metric(server, "atom_requests_total") > aborts)
    assert metric(server, "atom_generation_tokens_total") - before >= received


def test_models_by_id(server: Proc) -> None:
    r = httpx.get(f"{server.url}/v1/models/{MODEL}", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    r = httpx.get(server.url + "/v1/models/gpt-4", headers=AUTH)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_status_needs_the_key_and_probes_stay_open(server: Proc) -> None:
    r = httpx.get(server.url + "/status")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/livez", "/metrics"):
        assert httpx.get(server.url + path).status_code == 200, path
    for scheme in ("bearer", "BEARER", "Bearer"):  # case-insensitive (RFC 9110)
        r = httpx.get(server.url + "/status", headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, scheme
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {KEY}"})
    assert r.status_code == 200
    assert httpx.get(server.url + "/status", headers={"Authorization": "Bearer nope"}).status_code == 401


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_pd_role_without_the_internal_token_refuses_to_start(role: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "atom.cli.main", "serve", *TINY_SERVER_ARGS, "--role", role,
         "--port", "0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"--role {role} needs {TOKEN_ENV}" in lines[0]
    assert time.monotonic() - t0 < 60  # refused before any engine process starts
