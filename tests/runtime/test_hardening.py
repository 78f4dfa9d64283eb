"""Requests that used to kill, confuse or slip past a real server (issue 27, items 1, 6, 8):
numbers beyond what the engine represents, oversized lists, unsupported OpenAI fields, bodies
that are not usable JSON, and /metrics counting every answer by status. One tiny-llama server
process on loopback (CPU, level 0); after every reproduction it still serves.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_proc import Proc, healthy_server

MODEL = "tiny-llama"
BASE = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    yield from healthy_server("--max-model-len", "256", "--num-kv-blocks", "64")


def post(server: Proc, body: object, path: str = "/v1/completions", **kw: object) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        headers = {"Content-Type": "application/json", **kw.pop("headers", {})}  # type: ignore[dict-item]
        return httpx.post(server.url + path, content=body, headers=headers, timeout=30, **kw)
    return httpx.post(server.url + path, json=body, timeout=30, **kw)


def assert_serving(server: Proc) -> None:
    assert server.proc.poll() is None, server.log()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    r = post(server, BASE)
    assert r.status_code == 200, r.text


def assert_400(r: httpx.Response, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def responses_by_status(server: Proc) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {
        s.labels["status"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "atom_http_responses_total"
    }


def test_top_k_beyond_int64_is_400_and_the_server_lives(server: Proc) -> None:
    err = assert_400(post(server, {**BASE, "top_k": 2**63, "temperature": 1.0}), "top_k")
    assert "2**63" in err["message"]
    assert_400(post(server, {**BASE, "top_k": 10**30}), "top_k")
    assert_serving(server)
    # within int64 but above the vocabulary: every token is a candidate (clamped, as vLLM)
    r = post(server, {**BASE, "top_k": 2**63 - 1, "temperature": 1.0, "seed": 3})
    assert r.status_code == 200, r.text
    assert_serving(server)


@pytest.mark.parametrize("seed", [2**64, 2**63, -(2**63) - 1, 10**40])
def test_seed_outside_int64_is_400_naming_seed(server: Proc, seed: int) -> None:
    err = assert_400(post(server, {**BASE, "seed": seed, "temperature": 1.0}), "seed")
    assert "64-bit" in err["message"]


def test_seed_at_the_int64_edges_is_served(server: Proc) -> None:
    for seed in (2**63 - 1, -(2**63), -1):
        r = post(server, {**BASE, "seed": seed, "temperature": 0.8})
        assert r.status_code == 200, r.text
    assert_serving(server)


def test_sizes_are_refused_before_the_engine(server: Proc) -> None:
    err = assert_400(post(server, {**BASE, "prompt": [1] * 100_000}), "prompt")
    assert err["code"] == "context_length_exceeded" and "100000 tokens" in err["message"]
    assert_400(
        post(server, {**BASE, "prompt": "x" * 256 * 257}), "prompt", "context_length_exceeded"
    )
    assert_400(post(server, {**BASE, "stop_token_ids": list(range(300))}), "stop_token_ids")
    assert_400(post(server, {**BASE, "stop_token_ids": [2**70]}), "stop_token_ids")
    assert_400(post(server, {**BASE, "stop": ["a"] * 17}), "stop")
    assert_400(post(server, {**BASE, "stop": "s" * 2000}), "stop")
    many = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 5000}
    assert_400(post(server, many, "/v1/chat/completions"), "messages")
    assert_serving(server)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        # response_format, tools and tool_choice are served since issue 45
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
    ],
)
def test_unsupported_fields_are_400_naming_the_field(
    server: Proc, field: str, value: object
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", BASE)):
        err = assert_400(post(server, {**body, field: value}, path), field)
        assert "not supported" in err["message"]


def test_unsupported_fields_through_the_openai_client(server: Proc) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, functions=[{"name": "f", "parameters": {}}]
        )
    assert err.value.body["param"] == "functions"
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=2, stream_options={"include_usage": True}
        )
    assert err.value.body["param"] == "stream_options"
    # the no-op values stay accepted
    ok = c.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=2, response_format={"type": "text"}, logit_bias={}
    )
    assert ok.usage.completion_tokens == 2


def test_malformed_bodies_are_json_400s(server: Proc) -> None:
    before = responses_by_status(server)
    # a lone surrogate: valid JSON, not a character
    assert_400(
        post(server, b'{"model": "tiny-llama", "prompt": "a\\ud800b"}'), code="invalid_unicode"
    )
    assert_400(post(server, b'{"model": "tiny-llama", "prompt": "x", "user": "\\udfff"}'))
    # a proper surrogate pair is a character and is served
    r = post(server, b'{"model": "tiny-llama", "prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text
    # nested 100k deep (Python's parser gives up), and 40 deep (it would not)
    assert_400(post(server, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    assert_400(post(server, b'{"model": "tiny-llama", "x": ' + b"[" * 40 + b"]" * 40 + b"}"))
    assert_400(post(server, b'{"model": "tiny-llama", "max_tokens": 1' + b"0" * 5000 + b"}"))
    # Content-Encoding: bogus, unsupported, and claimed but not true
    raw = json.dumps(BASE).encode()
    for enc in ("foo", "br", "zstd"):
        r = post(server, raw, headers={"Content-Encoding": enc})
        assert_400(r, code="unsupported_content_encoding")
    for enc in ("gzip", "deflate"):
        r = post(server, b"\x1f\x8b garbage", headers={"Content-Encoding": enc})
        assert_400(r, code="invalid_content_encoding")
    r = post(server, gzip.compress(raw), headers={"Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    r = post(server, zlib.compress(raw), headers={"Content-Encoding": "deflate"})
    assert r.status_code == 200, r.text
    # a gzip bomb inflating past the body limit is a 413, not 32 MB+ of memory
    bomb = gzip.compress(b" " * (40 << 20))
    r = post(server, bomb, headers={"Content-Encoding": "gzip"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    assert_400(post(server, b"\xff\xfe{}"))
    assert post(server, b"{}", "/nope").status_code == 404
    after = responses_by_status(server)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("400") == 11 and delta.get("413") == 1 and delta.get("404") == 1, delta
    assert delta.get("200", 0) >= 3  # the served requests (and /metrics is not counted yet)
    assert_serving(server)
