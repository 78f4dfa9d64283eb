"""The real server process on the tiny dummy Llama (CPU, level 0), driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Proc, start_server
from test_tokenizer import write_bpe_model_dir

from atom.tokenizer import load_tokenizer

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    proc = start_server("--max-num-seqs", "64", "--num-kv-blocks", "1024")
    try:
        proc.wait_healthy()
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server: Proc) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def requests_total(url: str, finish_reason: str | None = None) -> float:
    return sum(
        v
        for (name, labels), v in metric_samples(url).items()
        if name == "atom_requests_total"
        and (finish_reason is None or ("finish_reason", finish_reason) in labels)
    )


def test_models_and_health(server: Proc, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_greedy_stream_equals_whole(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "prompt": "The capital of France is",
        # Long enough to outlast the stream's set-up: a few tokens can all be out before the
        # response starts, and then arrive as one chunk (tiny-llama steps take under a ms).
        "max_tokens": 48,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**kw)
    again = client.completions.create(**kw)
    assert whole.choices[0].text == again.choices[0].text  # greedy is deterministic
    assert whole.usage.completion_tokens == 48 and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == 1 + len(b"The capital of France is")  # BOS + bytes
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in chunks if c.choices[0].text) >= 2  # delivered incrementally


def test_chat_stream_and_whole(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "temperature": 0.0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kw)
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 8
    assert whole.usage.prompt_tokens == 1 + len(
        b"system: be terse\nuser: hi\nassistant:"
    )  # the plain template
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_seeded_sampling_is_reproducible_and_logprobs(client: openai.OpenAI) -> None:
    kw = {
        "model": MODEL,
        "prompt": "abc",
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 1234,
        "logprobs": 1,
        "extra_body": {"ignore_eos": True},
    }
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    lps = a.choices[0].logprobs.token_logprobs
    assert len(lps) == 10 and all(lp <= 0.0 for lp in lps)


@pytest.mark.parametrize(
    ("kwargs", "exc", "fragment"),
    [
        (
            {"prompt": "x", "max_tokens": -3},
            openai.BadRequestError,
            "max_tokens must be at least 1",
        ),
        (
            {"prompt": "x", "max_tokens": 10**7},
            openai.BadRequestError,
            "maximum context length is 2048",
        ),
        (
            {"prompt": "x" * 3000, "max_tokens": 1},
            openai.BadRequestError,
            "your prompt has 3001 tokens",
        ),
        ({"prompt": "x", "model": "gpt-4"}, openai.NotFoundError, "does not exist"),
        (
            {"prompt": "x", "extra_body": {"max_tokens": "many"}},
            openai.BadRequestError,
            "valid integer",
        ),
        ({"prompt": "x", "temperature": 5.0}, openai.BadRequestError, "temperature"),
        ({"prompt": [1, 2, 100000]}, openai.BadRequestError, "token ids must be in [0, 256)"),
    ],
)
def test_bad_requests_via_openai_client(
    client: openai.OpenAI, kwargs: dict, exc: type[openai.APIStatusError], fragment: str
) -> None:
    kwargs = {"model": MODEL, **kwargs}
    with pytest.raises(exc) as info:
        client.completions.create(**kwargs)
    assert info.value.status_code in (400, 404)
    assert fragment in info.value.body["message"]
    assert info.value.body["type"] == "invalid_request_error"


def test_malformed_json_is_400(server: Proc) -> None:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


def test_200_concurrent_requests_complete_batched(server: Proc) -> None:
    before_steps = httpx.get(server.url + "/status").json()["steps"]
    before_done = requests_total(server.url, "length")

    async def run() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=250)
        async with httpx.AsyncClient(timeout=120, limits=limits) as c:
            body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True, "temperature": 0.0}
            return await asyncio.gather(
                *(
                    c.post(server.url + "/v1/completions", json={**body, "prompt": f"request {i}"})
                    for i in range(200)
                )
            )

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * 200
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)
    assert requests_total(server.url, "length") - before_done == 200
    # 800 tokens in far fewer engine steps than one request at a time would need (5 per request)
    steps = httpx.get(server.url + "/status").json()["steps"] - before_steps
    assert steps < 200, steps


def test_metrics_and_status(server: Proc, client: openai.OpenAI) -> None:
    client.completions.create(
        model=MODEL, prompt="metrics", max_tokens=3, extra_body={"ignore_eos": True}
    )
    samples = metric_samples(server.url)
    names = {name for name, _ in samples}
    for name in (
        "atom_time_to_first_token_seconds_count",
        "atom_inter_token_latency_seconds_bucket",
        "atom_num_requests_running",
        "atom_num_requests_waiting",
        "atom_kv_blocks_used",
        "atom_kv_blocks_total",
        "atom_capture_seconds",
        "atom_captured_buckets",
        "atom_eager_steps_total",
        "atom_graph_replays_total",
        "atom_cache_hits_total",
        "atom_cache_misses_total",
    ):
        assert name in names, name
    assert samples[("atom_kv_blocks_total", ())] == 1024
    assert samples[("atom_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("atom_eager_steps_total", ())] > 0  # level 0 on CPU: every step is eager
    assert samples[("atom_graph_replays_total", ())] == 0
    status = httpx.get(server.url + "/status").json()
    assert status["level"] == 0 and status["mode"] == "NONE" and status["buckets"] == []
    assert status["role"] == "unified" and status["model"] == MODEL and status["ready"] is True
    assert status["max_model_len"] == 2048 and "cache_key" in status


def test_client_disconnect_frees_sequence(server: Proc) -> None:
    before = requests_total(server.url, "abort")
    body = {
        "model": MODEL,
        "prompt": "long",
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += bool(line)
            if seen >= 3:
                break  # hang up mid-generation
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        status = httpx.get(server.url + "/status").json()
        if status["stats"]["running"] == 0 and status["in_flight"] == 0:
            break
        time.sleep(0.05)
    assert status["stats"]["running"] == 0 and status["stats"]["kv_blocks_used"] == 0
    assert requests_total(server.url, "abort") == before + 1


def test_sigterm_finishes_in_flight_and_exits_zero() -> None:
    proc = start_server()
    try:
        proc.wait_healthy()

        async def run() -> tuple[httpx.Response, int]:
            async with httpx.AsyncClient(timeout=60) as c:
                req = asyncio.create_task(
                    c.post(
                        proc.url + "/v1/completions",
                        json={
                            "model": MODEL,
                            "prompt": "bye",
                            "max_tokens": 120,
                            "ignore_eos": True,
                        },
                    )
                )
                for _ in range(100):  # wait until the request is being generated
                    if httpx.get(proc.url + "/status").json()["in_flight"]:
                        break
                    await asyncio.sleep(0.02)
                code = await asyncio.get_running_loop().run_in_executor(None, proc.terminate)
                return await req, code

        response, code = asyncio.run(run())
        assert code == 0, proc.log()
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 120
        assert "shut down" in proc.log()
    finally:
        proc.stop()


def test_model_directory_with_hf_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """A checkpoint directory's tokenizer.json and chat template are what the server uses."""
    write_bpe_model_dir(tmp_path)
    config = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 256,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path), 512)
    proc = start_server("--model", str(tmp_path), "--served-model-name", "bpe")
    try:
        proc.wait_healthy()
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        chat = c.chat.completions.create(
            model="bpe",
            messages=[{"role": "user", "content": "hello world"}],
            max_tokens=3,
            extra_body={"ignore_eos": True},
        )
        rendered = "<s><|user|>hello world<|end|><|assistant|>"
        # the template's own <s> is the only BOS: nothing is added on top of it
        assert chat.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
        comp = c.completions.create(
            model="bpe", prompt="the quick brown fox", max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert (
            comp.usage.prompt_tokens
            == len(tok.encode("the quick brown fox"))
            < len("the quick brown fox")
        )
        assert httpx.get(proc.url + "/status").json()["max_model_len"] == 256
    finally:
        proc.stop()
