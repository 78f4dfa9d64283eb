"""Disaggregated serving with real processes on loopback: two prefill instances, one decode
instance and the router, against one unified instance on the same weights (tiny dummy Llama,
CPU, level 0), driven by the official openai client.

The tests share the processes and run in file order; the last one kills a prefill instance.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Proc, start_router, start_server

from atom.disagg.holds import KVHoldRegistry
from atom.disagg.layout import KVLayout
from atom.disagg.server import KVServer, KVSource
from atom.wire.trust import TOKEN_ENV, TOKEN_HEADER

MODEL = "tiny-llama"
HOLD_S = 3.0  # prefill-1 frees unpulled blocks after this
TOKEN = "test-internal-token"
P_D = {TOKEN_ENV: TOKEN}  # router, prefill and decode share it; the unified instance has none
INTERNAL = {TOKEN_HEADER: TOKEN}  # what the router sends: these tests stand in for it


@dataclass
class Cluster:
    unified: Proc
    prefill1: Proc
    prefill2: Proc
    decode: Proc
    router: Proc

    @property
    def runtimes(self) -> list[Proc]:
        return [self.unified, self.prefill1, self.prefill2, self.decode]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    kv = ("--kv-port", "0")
    procs = [
        start_server(),
        start_server("--role", "prefill", *kv, "--kv-hold-seconds", str(HOLD_S), env=P_D),
        start_server("--role", "prefill", *kv, env=P_D),
        start_server("--role", "decode", env=P_D),
    ]
    router = None
    try:
        for p in procs:
            p.wait_healthy()
        router = start_router(
            [procs[1].url, procs[2].url],
            [procs[3].url],
            "--health-interval",
            "0.5",
            "--health-timeout",
            "1",
            env=P_D,
        )
        router.wait_healthy()
        yield Cluster(*procs, router)
    finally:
        for p in [router, *procs]:
            if p is not None:
                p.stop()


def client(proc: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60)


def metric(proc: Proc, name: str, **labels: str) -> float:
    text = httpx.get(proc.url + "/metrics").text
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def kv_status(proc: Proc) -> dict:
    status = httpx.get(proc.url + "/status").json()
    return {**status["kv"], "kv_blocks_used": status["stats"]["kv_blocks_used"]}


def wait_for_status(proc: Proc, ok: Callable[[dict], bool], timeout_s: float) -> dict:
    """The instance's kv_status once ok(status) holds, or the last one seen at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not ok(state := kv_status(proc)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


def wait_until_free(procs: list[Proc], timeout_s: float) -> None:
    """Every instance's cache back to empty: nothing held, nothing in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [kv_status(p) for p in procs]
        if all(s["blocks_held"] == 0 and s["kv_blocks_used"] == 0 for s in states):
            return
        assert time.monotonic() < deadline, f"blocks not freed: {states}"
        time.sleep(0.05)


GREEDY = {"model": MODEL, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_router_gives_the_unified_tokens_for_many_prompts_at_once(cluster: Cluster) -> None:
    # Lengths around block edges (16 tokens) and a few budgets, all sent together.
    prompts = [("The quick brown fox " * (1 + i % 7))[: 3 + 9 * i] for i in range(16)]
    budgets = [1, 2, 9, 12] * 4
    via_router, direct = client(cluster.router), client(cluster.unified)

    def run(c: openai.OpenAI, i: int) -> str:
        return (
            c.completions.create(prompt=prompts[i], max_tokens=budgets[i], **GREEDY).choices[0].text
        )

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: run(via_router, i), range(16)))
        want = list(pool.map(lambda i: run(direct, i), range(16)))
    assert got == want
    assert len(set(want)) > 8  # the prompts really differ

    # streaming and chat take the same path
    kw = {"prompt": prompts[5], "max_tokens": 10, **GREEDY}
    streamed = "".join(c.choices[0].text for c in via_router.completions.create(**kw, stream=True))
    assert streamed == direct.completions.create(**kw).choices[0].text
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, **GREEDY}
    a = via_router.chat.completions.create(**chat)
    b = direct.chat.completions.create(**chat)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens == 6

    # the blocks really moved, from both prefill instances, and every copy was freed
    sent = [metric(p, "atom_kv_transfer_bytes_total", direction="sent")
            for p in (cluster.prefill1, cluster.prefill2)]  # fmt: skip
    assert all(s > 0 for s in sent)
    assert metric(cluster.decode, "atom_kv_transfer_bytes_total", direction="received") == sum(sent)
    # one pull per request, except the four with a budget of one token (released unread)
    assert metric(cluster.decode, "atom_kv_transfer_seconds_count", direction="received") == 14
    wait_until_free(cluster.runtimes, timeout_s=5)


def test_router_passes_the_request_surface_through(cluster: Cluster) -> None:
    """n, logprobs/top_logprobs, penalties, logit_bias, seed and response_format reach both
    roles unchanged, and the prefill instance applies them to the first token: every answer
    equals the unified instance's (issue 45, item 5)."""
    via_router, direct = client(cluster.router), client(cluster.unified)
    ignore = {"ignore_eos": True}
    completions = [
        # greedy, the bias forcing one token: the first (the prefill's) too
        {"prompt": "bias me", "max_tokens": 5, "logprobs": 3, "logit_bias": {"100": 100},
         "temperature": 0.0, "extra_body": ignore},
        {"prompt": "aaaa aaaa", "max_tokens": 12, "logprobs": 0, "temperature": 0.0,
         "presence_penalty": 1.0, "frequency_penalty": 1.0,
         "extra_body": {**ignore, "repetition_penalty": 1.5}},
        # seeded choices: the first continues the prefill's token, the second runs on decode
        {"prompt": "two ways", "max_tokens": 6, "n": 2, "seed": 4, "temperature": 1.0,
         "extra_body": ignore},
    ]
    for kw in completions:
        a = via_router.completions.create(model=MODEL, **kw)
        b = direct.completions.create(model=MODEL, **kw)
        assert [c.text for c in a.choices] == [c.text for c in b.choices], kw
        if kw.get("logprobs") is not None:
            la, lb = a.choices[0].logprobs, b.choices[0].logprobs
            assert la.tokens == lb.tokens and la.token_logprobs == pytest.approx(lb.token_logprobs)
            assert [sorted(t) for t in la.top_logprobs] == [sorted(t) for t in lb.top_logprobs]
    assert a.usage.completion_tokens == b.usage.completion_tokens == 12  # the n=2 case: 2 x 6
    forced = via_router.completions.create(model=MODEL, **completions[0]).choices[0]
    assert len(set(forced.logprobs.tokens)) == 1
    chat = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "logprobs": True, "top_logprobs": 3, "temperature": 0.0, "extra_body": ignore,
            "response_format": {"type": "json_object"}}
    a = via_router.chat.completions.create(model=MODEL, **chat)
    b = direct.chat.completions.create(model=MODEL, **chat)
    assert a.choices[0].message.content == b.choices[0].message.content
    ta = [[x.token for x in e.top_logprobs] for e in a.choices[0].logprobs.content]
    tb = [[x.token for x in e.top_logprobs] for e in b.choices[0].logprobs.content]
    assert ta == tb and len(ta) == 6 and all(len(t) == 3 for t in ta)
    wait_until_free(cluster.runtimes, timeout_s=5)


def test_decode_refuses_blocks_of_another_model(cluster: Cluster) -> None:
    mine = httpx.get(cluster.decode.url + "/status").json()["kv"]["identity"]
    decode_layout = KVLayout(mine, MODEL, "float32", 16, 2, 2, 16)  # tiny-llama's cache
    other = KVLayout(
        **{**decode_layout.to_dict(), "identity": "0123456789abcdef", "model": "other"}
    )
    prompt = [1, 5, 6, 7, 8]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}

    def handle(port: int, layout: KVLayout) -> dict:
        return {
            "version": 1,
            "handle": "h1",
            "kv_host": "127.0.0.1",
            "kv_port": port,
            "identity": layout.identity,
            "model": layout.model,
            "num_blocks": 1,
            "prompt_token_ids": prompt,
            "first_token_id": 3,
            "mode": "decode",
        }

    async def main() -> None:
        # A KV server holding blocks of another model, whose handle claims the decode's model:
        # the wire's layout check refuses before any block is read or written.
        holds = KVHoldRegistry(30.0)
        holds.hold("h1", [0], len(prompt))
        cache = torch.zeros(2, 2, 2, 16, 2, 16)
        srv = KVServer(lambda: KVSource(other, holds, cache))
        port = await srv.start("127.0.0.1", 0)
        async with httpx.AsyncClient(timeout=30, headers=INTERNAL) as c:
            url = cluster.decode.url + "/v1/completions"
            r = await c.post(url, json={**body, "kv_transfer": handle(port, decode_layout)})
            err = r.json()["error"]
            assert r.status_code == 409 and err["code"] == "kv_mismatch"
            assert "model identity differs" in err["message"] and "'other'" in err["message"]
            assert f"127.0.0.1:{port}" in err["message"]
            assert holds.begin_pull("h1") is not None  # nothing was taken
            # a handle that says so up front is refused without connecting at all
            r = await c.post(url, json={**body, "kv_transfer": handle(port, other)})
            assert r.status_code == 409 and "model identity differs" in r.json()["error"]["message"]
        await srv.close()

    asyncio.run(main())
    assert kv_status(cluster.decode)["kv_blocks_used"] == 0


def test_blocks_not_pulled_are_freed_after_the_timeout(cluster: Cluster) -> None:
    p = cluster.prefill1
    expired = kv_status(p)["holds_expired"]
    body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 1, "kv_transfer": {"mode": "prefill"}}
    r = httpx.post(p.url + "/v1/completions", json=body, headers=INTERNAL)
    assert r.status_code == 200
    handle = r.json()["kv_transfer"]
    assert handle["num_blocks"] == 3 and handle["expires_in"] == HOLD_S  # BOS + 40 bytes
    # /status shows the core's last stats message, which may trail the response a moment
    held = wait_for_status(p, lambda s: s["blocks_held"] == 3 and s["kv_blocks_used"] == 3, 2.0)
    assert held["blocks_held"] == 3 and held["kv_blocks_used"] == 3, held
    t0 = time.monotonic()
    wait_until_free([p], timeout_s=HOLD_S + 3)
    assert time.monotonic() - t0 > HOLD_S - 1.0
    assert kv_status(p)["holds_expired"] == expired + 1
    # a decode instance that comes too late gets a clear answer, and nothing is allocated
    late = {**handle, "mode": "decode", "kv_host": "127.0.0.1"}
    body = {"model": MODEL, "prompt": "x" * 40, "max_tokens": 4, "kv_transfer": late}
    r = httpx.post(cluster.decode.url + "/v1/completions", json=body, headers=INTERNAL)
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_unknown_handle"
    assert "expired" in r.json()["error"]["message"]
    assert kv_status(cluster.decode)["kv_blocks_used"] == 0


def test_killing_a_prefill_mid_request_is_a_503_and_serving_goes_on(cluster: Cluster) -> None:
    dying = cluster.prefill1
    os.kill(dying.proc.pid, signal.SIGSTOP)  # frozen with requests in hand, then killed
    via_router = client(cluster.router)
    kw = {"prompt": "still there?", "max_tokens": 4, **GREEDY}

    def call() -> object:
        try:
            return via_router.completions.create(**kw).choices[0].text
        except openai.APIStatusError as exc:
            return exc

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # least outstanding: one lands on each prefill instance
        calls = [pool.submit(call) for _ in range(2)]
        done, _ = concurrent.futures.wait(calls, timeout=30, return_when="FIRST_COMPLETED")
        assert len(done) == 1 and isinstance(next(iter(done)).result(), str)
        os.kill(dying.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        failed = [c for c in calls if c not in done][0].result(timeout=30)
    assert time.monotonic() - t0 < 10
    assert isinstance(failed, openai.APIStatusError) and failed.status_code == 503
    err = failed.body if isinstance(failed.body, dict) else {}
    assert err.get("code") == "prefill_failed"
    # named as the router names it (--prefill order), never by address (issue 48)
    name = "prefill-1" if dying is cluster.prefill1 else "prefill-2"
    assert f"{name} failed during the request" in err.get("message", "")
    assert dying.url not in err.get("message", "")
    # the next requests go to the remaining prefill instance
    want = client(cluster.unified).completions.create(**kw).choices[0].text
    assert [call() for _ in range(4)] == [want] * 4
    health = httpx.get(cluster.router.url + "/health").json()
    assert [b["healthy"] for b in health["backends"]["prefill"]] == [False, True]
    wait_until_free([cluster.prefill2, cluster.decode], timeout_s=5)
