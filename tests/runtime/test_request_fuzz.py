"""Property test (hypothesis): random and extreme request bodies against a real server process
(tiny-llama, CPU, level 0, loopback) never get a 5xx, never kill the engine, and leave the server
healthy. Each body mixes plausible fields with wrong types, huge and negative numbers, NaN and
infinities, lone surrogates, unsupported OpenAI fields and nested junk.

Bounded for CI: 200 examples, derandomized (the same bodies every run), no deadline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from server_proc import Proc, healthy_server

MODEL = "tiny-llama"
# Every status the server documents for a client's request; 5xx are for the server's own state
# (503 not ready / shutting down / engine down), which must not happen here.
CLIENT_STATUSES = {200, 400, 404, 413}

EXTREME_INTS = [0, 1, -1, 2, 16, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1,
                10**30, -(10**30)]  # fmt: skip
EXTREME_FLOATS = [0.0, -0.0, 1e-300, 0.5, 1.0, 2.0, 2.0000001, -1.0, 1e308, float("inf"),
                  float("-inf"), float("nan")]  # fmt: skip
text = st.text(st.characters(codec=None), max_size=40)  # lone surrogates included
ints = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-(2**70), 2**70))
floats = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(allow_nan=True))
junk = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, floats, text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=6,
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the field's own kind, sometimes anything at all."""
    return st.one_of(*[strategy] * 5, junk)


small_ints = st.one_of(st.integers(-2, 40), ints)
token_ids = st.lists(st.one_of(st.integers(0, 300), ints), max_size=12)
COMMON = {
    "max_tokens": maybe(small_ints),
    "temperature": maybe(floats),
    "top_p": maybe(floats),
    "top_k": maybe(ints),
    "seed": maybe(ints),
    "stop": maybe(st.one_of(text, st.lists(text, max_size=20))),
    "stop_token_ids": maybe(token_ids),
    "ignore_eos": maybe(st.booleans()),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": maybe(st.booleans())})),
    "n": maybe(ints),
    "presence_penalty": maybe(floats),
    "frequency_penalty": maybe(floats),
    "user": maybe(text),
    "response_format": maybe(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "tools": maybe(st.just([])),
    "logit_bias": maybe(st.dictionaries(st.sampled_from(["1", "50"]), floats, max_size=2)),
    "best_of": maybe(ints),
}
completion = st.fixed_dictionaries(
    {
        "model": st.one_of(st.just(MODEL), st.just(MODEL), junk),
        "prompt": maybe(st.one_of(text, token_ids, st.lists(text, max_size=2))),
    },
    optional={
        **COMMON,
        "echo": maybe(st.booleans()),
        "logprobs": maybe(small_ints),
        "suffix": maybe(text),
    },
)
message = st.fixed_dictionaries(
    {
        "role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "x"]), junk),
        "content": maybe(
            st.one_of(
                text,
                st.lists(
                    st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2
                ),
            )  # fmt: skip
        ),
    }
)
chat = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), junk), "messages": maybe(st.lists(message, max_size=4))},
    optional={
        **COMMON,
        "max_completion_tokens": maybe(small_ints),
        "logprobs": maybe(st.booleans()),
        "top_logprobs": maybe(small_ints),
    },
)

# Valid bodies at the edges of every range: these reach the engine (top_k far above the
# vocabulary, seeds at the int64 bounds, temperatures near 0 and at 2, a budget of one).
INT64 = st.integers(-(2**63), 2**63 - 1)
engine_bound = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(
            st.text(max_size=30), st.lists(st.integers(0, 255), min_size=1, max_size=20)
        ),  # fmt: skip
        "max_tokens": st.integers(1, 6),
    },
    optional={
        "temperature": st.one_of(st.just(0.0), st.floats(1e-6, 2.0)),
        "top_p": st.one_of(st.just(1.0), st.floats(1e-6, 1.0)),
        "top_k": st.one_of(st.just(-1), st.integers(1, 2**63 - 1)),
        "seed": st.one_of(INT64, st.sampled_from([2**63 - 1, -(2**63), 0, -1])),
        "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
        "stop_token_ids": st.lists(st.integers(0, 255), max_size=8),
        "ignore_eos": st.booleans(),
        "stream": st.booleans(),
        "logprobs": st.sampled_from([0, 1]),
    },
)


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    yield from healthy_server("--max-model-len", "48", "--num-kv-blocks", "32")


@pytest.fixture(scope="module")
def http(server: Proc) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def check_answer(r: httpx.Response, body: dict[str, Any]) -> None:
    assert r.status_code in CLIENT_STATUSES, (r.status_code, r.text[:500], body)
    if r.status_code != 200:
        assert r.headers["content-type"].startswith("application/json"), r.text[:200]
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["type"] == "invalid_request_error"
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events), events[-3:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(body=st.one_of(completion, chat, engine_bound))
def test_random_and_extreme_bodies_never_get_a_5xx(http: httpx.Client, body: dict) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    raw = json.dumps(body).encode()  # NaN/Infinity literals and \\udXXX escapes go as they are
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    event(f"{path} {r.status_code}")  # --hypothesis-show-statistics: the mix of outcomes
    check_answer(r, body)


def test_server_is_healthy_and_serving_after_the_fuzz(server: Proc, http: httpx.Client) -> None:
    assert server.proc.poll() is None, server.log()
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
    status = http.get("/status").json()
    assert status["state"] == "ready" and status["in_flight"] == 0
    metrics = http.get("/metrics").text
    assert 'atom_http_responses_total{status="500"}' not in metrics
    assert "atom_requests_rejected_total{" not in metrics  # no generation answered 429/503
    assert 'atom_requests_total{endpoint="completions",finish_reason="length"}' in metrics
