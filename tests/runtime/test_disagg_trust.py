"""Who may steer KV transfers and read held blocks, and how many blocks holds may pin (issue 27,
items 3 and 4), with real server processes on loopback (tiny-llama, CPU, level 0).

- A client's `kv_transfer` without the router's internal token is 403 and the instance dials
  nothing (a listening socket records every connection attempt).
- A pull with a stolen handle but without its per-transfer secret reads nothing.
- Holds are capped by --max-held-kv-fraction; the router's release frees one at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import httpx
import pytest
from server_proc import Proc, start_server

from atom.disagg.client import KVTransferError, pull_kv
from atom.disagg.handle import KVHandle
from atom.disagg.layout import KVLayout
from atom.entrypoints.kv_release import RELEASE_PATH
from atom.wire.trust import TOKEN_ENV, TOKEN_HEADER

MODEL = "tiny-llama"
TOKEN = "trust-test-token"
INTERNAL = {TOKEN_HEADER: TOKEN}
NUM_BLOCKS, FRACTION = 64, 0.5  # cap: 32 blocks
PROMPT = list(range(1, 151))  # 150 tokens: 10 blocks of 16


@dataclass
class Instances:
    unified: Proc  # no token configured
    prefill: Proc
    decode: Proc


@pytest.fixture(scope="module")
def inst() -> Iterator[Instances]:
    env = {TOKEN_ENV: TOKEN}
    common = ("--max-model-len", "256", "--num-kv-blocks", str(NUM_BLOCKS))
    procs = [
        start_server(*common),
        start_server(
            *common,
            "--role",
            "prefill",
            "--kv-port",
            "0",
            "--kv-host",
            "127.0.0.1",
            "--max-held-kv-fraction",
            str(FRACTION),
            env=env,
        ),  # fmt: skip
        start_server(*common, "--role", "decode", env=env),
    ]
    try:
        for p in procs:
            p.wait_healthy()
        yield Instances(*procs)
    finally:
        for p in procs:
            p.stop()


class Listener:
    """A TCP port that counts the connections made to it (the would-be SSRF target)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


def forged_handle(port: int) -> dict:
    return {
        "mode": "decode",
        "version": 1,
        "handle": "cmpl-stolen",
        "kv_host": "127.0.0.1",
        "kv_port": port,
        "identity": "whatever",
        "model": MODEL,
        "num_blocks": 1,
        "prompt_token_ids": [1, 2, 3],
        "first_token_id": 5,
    }


def prefill(p: Proc, prompt: list[int] = PROMPT) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer": {"mode": "prefill"}}
    return httpx.post(p.url + "/v1/completions", json=body, headers=INTERNAL, timeout=60)


def kv(p: Proc) -> dict:
    return httpx.get(p.url + "/status").json()["kv"]


def kv_once(p: Proc, ok: Callable[[dict], bool], timeout_s: float = 2.0) -> dict:
    """kv(p) once ok holds (/status shows the core's last stats message, which may trail a
    response a moment), or the last one seen at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not ok(state := kv(p)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return state


def release(p: Proc, handle: dict, headers: dict | None = None) -> httpx.Response:
    body = {"handle": handle["handle"], "secret": handle.get("secret")}
    return httpx.post(
        p.url + RELEASE_PATH, json=body, headers=INTERNAL if headers is None else headers
    )


def wait_free(p: Proc, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while kv(p)["blocks_held"] != 0:
        assert time.monotonic() < deadline, kv(p)
        time.sleep(0.05)


def dial_with_token(decode: Proc, listener: Listener, body: dict) -> httpx.Response:
    """A decode request with the router's token and a handle whose KV is at `listener`."""
    handle = {**forged_handle(listener.port), "identity": kv(decode)["identity"]}
    return httpx.post(
        decode.url + "/v1/completions",
        json={**body, "kv_transfer": handle},
        headers=INTERNAL,
        timeout=60,
    )


def test_client_kv_transfer_without_the_token_is_403_and_dials_nothing(inst: Instances) -> None:
    target, canary = Listener(), Listener()
    try:
        body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}
        cases = [
            (inst.unified, {}),  # no token configured: always refused
            (inst.unified, {TOKEN_HEADER: TOKEN}),
            (inst.decode, {}),
            (inst.decode, {TOKEN_HEADER: "wrong"}),
            (inst.decode, {TOKEN_HEADER: ""}),
        ]
        for proc, headers in cases:
            for kv_transfer in (forged_handle(target.port), {"mode": "prefill"}, "junk"):
                r = httpx.post(
                    proc.url + "/v1/completions",
                    json={**body, "kv_transfer": kv_transfer},
                    headers=headers,
                )
                assert r.status_code == 403, (proc.url, headers, r.text)
                err = r.json()["error"]
                assert err["code"] == "kv_transfer_forbidden" and err["param"] == "kv_transfer"
        # The same request with the router's token dials, retries and answers within its
        # own handling: once one sent after them has done so elsewhere, a dial, retry or
        # release of the refused ones would have reached the target.
        dialed = dial_with_token(inst.decode, canary, body)
        assert dialed.status_code in (409, 503), dialed.text
        assert canary.connections >= 1
        assert target.connections == 0
        # and the target is not deaf: the same request with the token reaches it
        assert dial_with_token(inst.decode, target, body).status_code in (409, 503)
    finally:
        target.close()
        canary.close()
    assert target.connections >= 1


def test_stolen_handle_without_its_secret_reads_nothing(inst: Instances) -> None:
    r = prefill(inst.prefill, PROMPT[:40])
    assert r.status_code == 200, r.text
    handle = r.json()["kv_transfer"]
    assert len(handle["secret"]) == 32
    stolen = KVHandle.from_dict(handle)
    ident = kv(inst.decode)["identity"]
    layout = KVLayout(ident, MODEL, "float32", 16, 2, 2, 16)  # tiny-llama's cache

    async def pull(h: KVHandle) -> object:
        try:
            return await pull_kv(h, layout, timeout=10)
        except KVTransferError as exc:
            return exc

    for secret in ("", "0" * 32, handle["secret"][:-1] + "x"):
        got = asyncio.run(pull(replace(stolen, secret=secret)))
        assert isinstance(got, KVTransferError) and got.code == "kv_unknown_handle", got
    # still held, nothing was read
    assert kv_once(inst.prefill, lambda s: s["blocks_held"] == 3)["blocks_held"] == 3
    # the release route wants the token and the secret too
    assert release(inst.prefill, handle, headers={}).status_code == 403
    assert release(inst.prefill, {**handle, "secret": "nope"}).json() == {"released": False}
    # with the secret the pull works, and the blocks are freed
    pulled = asyncio.run(pull(stolen))
    assert not isinstance(pulled, KVTransferError), pulled
    assert pulled.blocks.shape[0] == 3
    wait_free(inst.prefill)


def test_unpulled_prefills_cannot_pin_more_than_the_cap(inst: Instances) -> None:
    cap = int(NUM_BLOCKS * FRACTION)
    rs = [prefill(inst.prefill) for _ in range(4)]
    assert [r.status_code for r in rs] == [200, 200, 200, 503]
    err = rs[3].json()["error"]
    assert err["code"] == "kv_hold_cap" and f"of {cap}" in err["message"]
    state = kv_once(inst.prefill, lambda s: s["blocks_held"] == 30 and s["hold_cap_refused"] >= 1)
    assert state["blocks_held"] == 30 <= cap and state["hold_cap_refused"] >= 1, state
    # the router's release frees one hold at once, and the next prefill fits again
    assert release(inst.prefill, rs[0].json()["kv_transfer"]).json() == {"released": True}
    r = prefill(inst.prefill)
    assert r.status_code == 200, r.text
    for got in (rs[1], rs[2], r):
        assert release(inst.prefill, got.json()["kv_transfer"]).json() == {"released": True}
    wait_free(inst.prefill)
    # four at once: the reservation counts prompts still running, so still three at most
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: prefill(inst.prefill), range(4)))
    assert sorted(r.status_code for r in rs) == [200, 200, 200, 503]
    assert kv(inst.prefill)["blocks_held"] <= cap
    for got in rs:
        if got.status_code == 200:
            release(inst.prefill, got.json()["kv_transfer"])
    wait_free(inst.prefill)
    # a served request still works afterwards, and the instance is healthy
    assert httpx.get(inst.prefill.url + "/health").status_code == 200
