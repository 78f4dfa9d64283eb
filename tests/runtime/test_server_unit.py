"""The HTTP layer against a scripted engine: exact text, stop strings, queue bound, disconnects.

The scripted engine emits the bytes of a known string, one token per step per sequence, so the
server's detokenisation, stop-string truncation, usage counts and abort paths can be checked
exactly; test_server.py runs the same API against the real engine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import torch

from atom.disagg.holds import KVHoldRegistry
from atom.engine.api import EngineAPI, EngineFacts
from atom.engine.params import RequestOutput, SamplingParams
from atom.entrypoints.api_server import serve
from atom.entrypoints.core.client import ThreadCore
from atom.entrypoints.state import ServerState
from atom.lora.service import LoRAService
from atom.tokenizer import ByteTokenizer

SCRIPT = "Hello wörld ✓ STOP after the stop"
EOS = 257


class ScriptedEngine(EngineAPI):
    """Implements the engine core's EngineAPI as LLMEngine does; every sequence generates
    SCRIPT's UTF-8 bytes, then EOS (the engine's own EOS rule: the server adds none)."""

    kv_holds: KVHoldRegistry | None = None  # holds nothing for a pull
    lora: LoRAService | None = None  # serves no LoRA adapter

    def __init__(self, max_num_seqs: int = 4, step_s: float = 0.002, script: str = SCRIPT) -> None:
        self.max_num_seqs = max_num_seqs
        self.step_s = step_s
        self.script = list(script.encode()) + [EOS]
        self.waiting: list[str] = []
        self.running: dict[str, dict[str, Any]] = {}
        self.seqs: dict[str, dict[str, Any]] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()  # only for the test's own reads

    def warmup(self) -> dict[str, Any]:
        return {"capture_seconds": 0.25, "captured_sizes": [1, 2, 4], "cache_key": "abc123"}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        *,
        hold_kv: bool = False,
        lora_name: str | None = None,
    ) -> None:
        params = params or SamplingParams()
        params.validate()
        if len(prompt_token_ids) > 100:
            raise ValueError("prompt has 101 tokens, above max_model_len")
        self.seqs[request_id] = {"prompt": len(prompt_token_ids), "params": params, "out": 0}
        self.waiting.append(request_id)

    def add_prefilled_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token: int,
        params: SamplingParams | None,
        kv_blocks: torch.Tensor | None,
        first_logprob: float | None = None,
        *,
        cached_tokens: int = 0,
    ) -> None:
        raise ValueError("the scripted engine runs no decode-role requests")

    def abort_request(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.seqs.pop(request_id, None)
        self.running.pop(request_id, None)
        if request_id in self.waiting:
            self.waiting.remove(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        while self.waiting and len(self.running) < self.max_num_seqs:
            rid = self.waiting.pop(0)
            self.running[rid] = self.seqs[rid]
        outs = []
        for rid, seq in list(self.running.items()):
            params: SamplingParams = seq["params"]
            tok = self.script[seq["out"] % len(self.script)]
            seq["out"] += 1
            reason = None
            if tok in params.stop_token_ids or (tok == EOS and not params.ignore_eos):
                reason = "stop"
            elif seq["out"] >= params.max_tokens:
                reason = "length"
            if reason:
                del self.running[rid]
                del self.seqs[rid]
            lp = [-0.5] if params.logprobs else None
            outs.append(
                RequestOutput(rid, [tok], lp, reason is not None, reason, seq["prompt"], seq["out"])
            )
        return outs

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_blocks_used": len(self.running),
            "kv_blocks_total": 64,
        }

    def facts(self) -> EngineFacts:
        return EngineFacts(max_model_len=0, vocab_size=0, eos_token_ids=[EOS])

    def reclaim_kv(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass

    def rank_failure(self, timeout: float) -> str | None:
        return None


def test_the_scripted_engine_implements_every_engine_api_method() -> None:
    """Subclassing the Protocol would inherit its empty bodies: each member is defined here."""
    members = {
        name for name in vars(EngineAPI) if not name.startswith("_") and name != "kv_holds"
    }
    assert members and members <= set(vars(ScriptedEngine))
    assert "kv_holds" in vars(ScriptedEngine)


async def wait_until(check: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    """Poll check() until it holds (the engine core runs in a thread of this process)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_with_server(
    fn: Callable[[str, ScriptedEngine], Awaitable[None]],
    engine: ScriptedEngine | None = None,
    max_waiting: int = 64,
    expect_exit: int = 0,
) -> None:
    engine = engine or ScriptedEngine()

    async def main() -> None:
        port = free_port()
        state = ServerState(
            engine=ThreadCore(lambda: engine),
            served_model_name="scripted",
            model="scripted",
            max_waiting=max_waiting,
        )
        state.tokenizer = ByteTokenizer(vocab_size=512)
        state.max_model_len = 128
        state.vocab_size = 512
        stop = asyncio.Event()
        server = asyncio.create_task(
            serve(state, "127.0.0.1", port, grace_s=2.0, stop=stop, install_signals=False)
        )
        base = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient() as client:
                for _ in range(200):
                    try:
                        if (await client.get(base + "/health")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.02)
            await fn(base, engine)
        finally:
            stop.set()
            assert await asyncio.wait_for(server, 10) == expect_exit

    asyncio.run(main())


def test_completion_text_usage_and_stop_string() -> None:
    async def check(base: str, engine: ScriptedEngine) -> None:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x")
        full = await client.completions.create(model="scripted", prompt="hi", max_tokens=100)
        assert full.choices[0].text == SCRIPT
        assert full.choices[0].finish_reason == "stop"  # EOS
        assert full.usage.prompt_tokens == 3  # BOS + "hi"
        assert full.usage.completion_tokens == len(SCRIPT.encode()) + 1
        cut = await client.completions.create(
            model="scripted", prompt="hi", max_tokens=100, stop=[" STOP"]
        )
        assert cut.choices[0].text == "Hello wörld ✓" and cut.choices[0].finish_reason == "stop"
        short = await client.completions.create(model="scripted", prompt="hi", max_tokens=5)
        assert short.choices[0].text == "Hello" and short.choices[0].finish_reason == "length"
        await client.close()
        # the stop-string request's sequence was aborted in the engine, not left running
        await wait_until(lambda: not engine.running and not engine.waiting, "the abort")
        assert not engine.seqs

    run_with_server(check)


def test_streaming_chat_chunks_and_usage() -> None:
    async def check(base: str, engine: ScriptedEngine) -> None:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x")
        messages = [{"role": "user", "content": "hi"}]
        stream = await client.chat.completions.create(
            model="scripted",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=14,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        # The content, not the chunk count: tokens that reach the stream together (a loaded
        # machine) go out as one chunk.
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == SCRIPT.encode()[:14].decode(
            errors="replace"
        )  # a cut character flushes as U+FFFD
        finals = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        assert finals == ["length"]
        tok = ByteTokenizer(vocab_size=512)
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 14)
        assert usage.total_tokens == len(prompt) + 14
        assert all(c.usage is None for c in chunks[:-1])  # usage comes once, last
        await client.close()

    run_with_server(check)


def test_sse_wire_format_ends_with_done_and_logprobs() -> None:
    async def check(base: str, engine: ScriptedEngine) -> None:
        async with httpx.AsyncClient() as client:
            r = await client.post(
                base + "/v1/completions",
                json={
                    "model": "scripted",
                    "prompt": "x",
                    "max_tokens": 3,
                    "stream": True,
                    "logprobs": 1,
                },
            )
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.text.split("\n\n") if line]
            assert events[-1] == "data: [DONE]"
            payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
            assert "".join(p["choices"][0]["text"] for p in payloads) == "Hel"
            # Tokens that reach the stream together go out as one chunk (a loaded machine
            # coalesces them): each chunk carries one logprob per token it holds.
            chunks = [p["choices"][0] for p in payloads]
            assert [lp for c in chunks for lp in c["logprobs"]["token_logprobs"]] == [-0.5] * 3
            assert all(
                len(c["logprobs"]["tokens"]) == len(c["logprobs"]["token_logprobs"])
                and "".join(c["logprobs"]["tokens"]) == c["text"]
                for c in chunks
            )
            whole = (
                await client.post(
                    base + "/v1/chat/completions",
                    json={
                        "model": "scripted",
                        "messages": [{"role": "user", "content": "x"}],
                        "max_tokens": 2,
                        "logprobs": True,
                    },
                )
            ).json()
            assert [c["token"] for c in whole["choices"][0]["logprobs"]["content"]] == ["H", "e"]

    run_with_server(check)


def test_queue_bound_answers_429() -> None:
    engine = ScriptedEngine(max_num_seqs=1, step_s=0.01)

    async def check(base: str, engine: ScriptedEngine) -> None:
        body = {"model": "scripted", "prompt": "x", "max_tokens": 100, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as client:

            async def first_token_seen() -> bool:  # by the API server, not only the engine
                text = (await client.get(base + "/metrics")).text
                return "atom_time_to_first_token_seconds_count 1.0" in text

            first = asyncio.create_task(client.post(base + "/v1/completions", json=body))
            await wait_until(lambda: len(engine.running) == 1, "the first to run")
            deadline = time.monotonic() + 10
            while not await first_token_seen():  # no longer counted as waiting
                assert time.monotonic() < deadline, "the first request's first token"
                await asyncio.sleep(0.005)
            second = asyncio.create_task(client.post(base + "/v1/completions", json=body))
            # The second waits behind it (max_num_seqs=1): admitted, no token yet.
            await wait_until(lambda: len(engine.waiting) == 1, "the second to queue")
            assert len(engine.running) == 1  # the first still runs: the queue holds one
            third = await client.post(base + "/v1/completions", json=body)
            assert third.status_code == 429
            assert third.json()["error"]["code"] == "rate_limit_exceeded"
            assert (await first).status_code == 200 and (await second).status_code == 200
            metrics = (await client.get(base + "/metrics")).text
            assert 'atom_requests_rejected_total{status="429"} 1.0' in metrics

    run_with_server(check, engine=engine, max_waiting=1)


def test_client_disconnect_aborts_sequence() -> None:
    engine = ScriptedEngine(step_s=0.01)

    async def check(base: str, engine: ScriptedEngine) -> None:
        body = {"model": "scripted", "prompt": "x", "max_tokens": 100, "ignore_eos": True}
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream(
                "POST", base + "/v1/completions", json={**body, "stream": True}
            ) as r:
                async for _ in r.aiter_lines():
                    break  # one event, then hang up
            # non-streaming: cancel the client call mid-generation
            await wait_until(lambda: len(engine.aborted) == 1, "the hang-up's abort")
            task = asyncio.create_task(client.post(base + "/v1/completions", json=body))
            await wait_until(
                lambda: any(rid not in engine.aborted for rid in list(engine.running)),
                "the second request to run",
            )
            task.cancel()
        for _ in range(100):
            if len(engine.aborted) == 2 and not engine.running:
                break
            await asyncio.sleep(0.02)
        assert len(engine.aborted) == 2 and not engine.running and not engine.seqs

    run_with_server(check, engine=engine)


def test_engine_refusal_is_400_and_health_metrics_status() -> None:
    async def check(base: str, engine: ScriptedEngine) -> None:
        async with httpx.AsyncClient() as client:
            ids = list(range(101))  # the engine refuses > 100 prompt tokens with a ValueError
            r = await client.post(
                base + "/v1/completions", json={"model": "scripted", "prompt": ids, "max_tokens": 1}
            )
            assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
            assert (await client.get(base + "/health")).json() == {"status": "ok"}
            status = (await client.get(base + "/status")).json()
            assert status["captured_buckets"] == [1, 2, 4] and status["cache_key"] == "abc123"
            assert status["model"] == "scripted" and status["role"] == "unified"
            await client.post(
                base + "/v1/completions", json={"model": "scripted", "prompt": "x", "max_tokens": 4}
            )
            metrics = (await client.get(base + "/metrics")).text
            assert (
                'atom_requests_total{endpoint="completions",finish_reason="length"} 1.0' in metrics
            )
            assert "atom_time_to_first_token_seconds_count 1.0" in metrics
            assert "atom_inter_token_latency_seconds_count 3.0" in metrics
            assert "atom_kv_blocks_total 64.0" in metrics
            assert "atom_capture_seconds 0.25" in metrics
            assert "atom_captured_buckets 3.0" in metrics

    run_with_server(check)


def test_health_is_503_with_reason_until_warm() -> None:
    gate = threading.Event()

    class SlowWarmup(ScriptedEngine):
        def warmup(self) -> dict[str, Any]:
            gate.wait(10)
            return {}

    async def main() -> None:
        port = free_port()
        state = ServerState(
            engine=ThreadCore(lambda: SlowWarmup()),
            served_model_name="s",
            model="s",
        )
        state.tokenizer, state.max_model_len, state.vocab_size = ByteTokenizer(512), 64, 512
        stop = asyncio.Event()
        server = asyncio.create_task(
            serve(state, "127.0.0.1", port, stop=stop, install_signals=False)
        )
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as client:
            for _ in range(100):
                try:
                    r = await client.get(base + "/health")
                    if r.json()["status"] == "warming":
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.02)
            assert r.status_code == 503 and "compiling" in r.json()["reason"]
            busy = await client.post(base + "/v1/completions", json={"model": "s", "prompt": "x"})
            assert busy.status_code == 503 and busy.json()["error"]["code"] == "not_ready"
            gate.set()
            for _ in range(100):
                if (await client.get(base + "/health")).status_code == 200:
                    break
                await asyncio.sleep(0.02)
            assert (await client.get(base + "/health")).status_code == 200
        stop.set()
        assert await server == 0

    asyncio.run(main())


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "fragment"),
    [
        ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
        ("/v1/completions", b"[1, 2]", 400, None, "JSON object"),
        (
            "/v1/completions",
            {"model": "scripted", "prompt": "x", "max_tokens": -1},
            400,
            "max_tokens",
            "at least 1",
        ),
        (
            "/v1/completions",
            {"model": "scripted", "prompt": "x", "max_tokens": 10**9},
            400,
            "max_tokens",
            "maximum context length is 128",
        ),
        (
            "/v1/completions",
            {"model": "scripted", "prompt": "x", "max_tokens": "5"},
            400,
            "max_tokens",
            "valid integer",
        ),
        (
            "/v1/completions",
            {"model": "scripted", "prompt": "y" * 200},
            400,
            "prompt",
            "maximum context length is 128",
        ),
        ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "model", "does not exist"),
        ("/v1/completions", {"prompt": "x"}, 400, "model", "Field required"),
        (
            "/v1/completions",
            {"model": "scripted", "prompt": "x", "temperature": "hot"},
            400,
            "temperature",
            "valid number",
        ),
        ("/v1/completions", {"model": "scripted", "prompt": "x", "n": 33}, 400, "n", "n must"),
        (
            "/v1/completions",
            {"model": "scripted", "prompt": [1, 999999]},
            400,
            "prompt",
            "token ids",
        ),
        (
            "/v1/chat/completions",
            {"model": "scripted", "messages": "hi"},
            400,
            "messages",
            "valid list",
        ),
        (
            "/v1/chat/completions",
            {"model": "scripted", "messages": [{"role": "wizard", "content": "x"}]},
            400,
            "messages",
            "role",
        ),
        (
            "/v1/chat/completions",
            {"model": "scripted", "messages": []},
            400,
            "messages",
            "at least one",
        ),
        (
            "/v1/chat/completions",
            {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "stream": "yes"},
            400,
            "stream",
            "valid boolean",
        ),
        ("/v1/nothing", {}, 404, None, "Not Found"),
    ],
)
def test_bad_requests_get_openai_errors(
    path: str, body: Any, status: int, param: str | None, fragment: str
) -> None:
    async def check(base: str, engine: ScriptedEngine) -> None:
        async with httpx.AsyncClient() as client:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            r = await client.post(
                base + path, content=content, headers={"content-type": "application/json"}
            )
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param
            assert fragment in err["message"], err["message"]
            # and the server is still fine afterwards
            ok = await client.post(
                base + "/v1/completions", json={"model": "scripted", "prompt": "x", "max_tokens": 2}
            )
            assert ok.status_code == 200

    run_with_server(check)


def test_engine_failure_mid_stream_reports_error_and_exits_1() -> None:
    class Failing(ScriptedEngine):
        def step(self) -> list[RequestOutput]:
            if sum(s["out"] for s in self.seqs.values()) >= 3:
                raise RuntimeError("device lost")
            return super().step()

    async def check(base: str, engine: ScriptedEngine) -> None:
        async with httpx.AsyncClient() as client:
            body = {"model": "scripted", "prompt": "x", "max_tokens": 50, "stream": True}
            r = await client.post(base + "/v1/completions", json=body)
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            # the tokens before the failure were streamed first; the server may coalesce
            # tokens that were ready together into one chunk, so compare the joined text
            streamed = "".join(
                json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-2]
            )
            assert streamed and SCRIPT[:3].startswith(streamed), streamed
            err = json.loads(events[-2][len("data: ") :])["error"]
            assert err["code"] == "engine_unavailable" and "device lost" in err["message"]

    # the process gives up (exit 1) so Kubernetes restarts it
    run_with_server(check, engine=Failing(), expect_exit=1)


def test_engine_build_failure_exits_1() -> None:
    def broken() -> EngineAPI:
        raise FileNotFoundError("no config.json")

    async def main() -> int:
        state = ServerState(
            engine=ThreadCore(broken), served_model_name="s", model="s"
        )
        return await asyncio.wait_for(
            serve(state, "127.0.0.1", free_port(), install_signals=False), 60
        )

    assert asyncio.run(main()) == 1
