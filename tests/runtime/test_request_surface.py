"""The OpenAI request surface through the official openai client, against one real server (tiny
dummy Llama, CPU, level 0): n and best_of (siblings share the prompt's cached blocks), logprobs
and top_logprobs in both endpoints' shapes, the penalties and logit_bias, seeds under batching,
stop strings across token boundaries, and 400s naming the field for out-of-range values.
"""

from __future__ import annotations

import concurrent.futures
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_proc import Proc, healthy_server

from testutil import wait_for

MODEL = "tiny-llama"
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server() -> Iterator[Proc]:
    yield from healthy_server("--max-num-seqs", "16")


@pytest.fixture(scope="module")
def client(server: Proc) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield c
    c.close()


def _cache_hits(server: Proc) -> int:
    return int(httpx.get(server.url + "/status").json()["stats"]["prefix_cache_hits"])


def test_n_choices_share_the_prompt_blocks_and_are_reproducible(
    server: Proc, client: openai.OpenAI
) -> None:
    prompt = [random.Random(7).randrange(3, 250) for _ in range(40)]  # 2 full blocks of 16
    hits = _cache_hits(server)
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "seed": 11,
          "extra_body": {"ignore_eos": True}}
    many = client.completions.create(n=3, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    # The siblings found both full blocks cached (choice 0 computed them): 2 x 32 tokens.
    wait_for("the siblings' cache hits", lambda: _cache_hits(server) == hits + 64, timeout=10)
    assert many.usage.prompt_tokens == 40 and many.usage.completion_tokens == 18
    texts = [c.text for c in many.choices]
    assert len(set(texts)) > 1  # distinct seeds (seed + index)
    again = client.completions.create(n=3, **kw)
    assert [c.text for c in again.choices] == texts
    # Choice 0 is the request's own seed, choice i the seed + i.
    assert client.completions.create(**kw).choices[0].text == texts[0]
    assert client.completions.create(**{**kw, "seed": 12}).choices[0].text == texts[1]


def test_n_streams_every_choice_by_index(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5,
          "temperature": 1.0, "seed": 3, "n": 2, "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    got = {0: "", 1: ""}
    roles = set()
    for c in chunks:
        for ch in c.choices:
            got[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.add(ch.index)
    assert roles == {0, 1}
    assert [got[0], got[1]] == [c.message.content for c in whole.choices]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10


def test_best_of_returns_the_highest_cumulative_logprob(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "best", "max_tokens": 5, "temperature": 1.0, "seed": 21,
          "extra_body": {"ignore_eos": True}}
    all3 = client.completions.create(n=3, logprobs=0, **kw)
    scores = [sum(c.logprobs.token_logprobs) for c in all3.choices]
    best = client.completions.create(n=1, best_of=3, **kw)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None  # none asked
    assert best.choices[0].text == all3.choices[scores.index(max(scores))].text
    two = client.completions.create(n=2, best_of=3, logprobs=0, **kw)
    ranked = sorted(scores, reverse=True)[:2]
    assert [sum(c.logprobs.token_logprobs) for c in two.choices] == pytest.approx(ranked)


def test_top_logprobs_in_both_shapes(client: openai.OpenAI) -> None:
    comp = client.completions.create(prompt="abc", max_tokens=4, logprobs=5, **GREEDY)
    lp = comp.choices[0].logprobs
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # Keyed by text: byte tokens that decode alike ("\ufffd") share one key.
        assert 2 <= len(top) <= 6 and token in top
        assert max(top.values()) == pytest.approx(chosen)  # greedy: the chosen is the best
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True,
        top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        alts = entry.top_logprobs
        assert len(alts) == 3 and alts[0].token == entry.token
        assert alts[0].logprob == pytest.approx(entry.logprob)
        assert [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
        assert alts[0].bytes == list(alts[0].token.encode())
    plain = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    streamed = client.completions.create(prompt="abc", max_tokens=4, logprobs=2, stream=True,
                                         **GREEDY)
    tops = [t for c in streamed for t in (c.choices[0].logprobs.top_logprobs
                                          if c.choices[0].logprobs else [])]
    whole = client.completions.create(prompt="abc", max_tokens=4, logprobs=2, **GREEDY)
    assert tops == whole.choices[0].logprobs.top_logprobs and len(tops) == 4


def test_penalties_and_logit_bias(client: openai.OpenAI) -> None:
    base = client.completions.create(prompt="aaaa", max_tokens=24, logprobs=0, **GREEDY)
    tokens = base.choices[0].logprobs.tokens
    forced = client.completions.create(prompt="aaaa", max_tokens=6, logprobs=0,
                                       logit_bias={"100": 100}, **GREEDY)
    assert len(set(forced.choices[0].logprobs.tokens)) == 1
    banned = {str(t): -100 for t in range(256) if t != 100}
    assert len(banned) <= 300
    only = client.completions.create(prompt="aaaa", max_tokens=3, logprobs=0,
                                     logit_bias=banned, **GREEDY)
    assert only.choices[0].logprobs.tokens == forced.choices[0].logprobs.tokens[:3]
    pen = client.completions.create(prompt="aaaa", max_tokens=24, logprobs=0,
                                    presence_penalty=2.0, frequency_penalty=2.0, **GREEDY)
    assert len(set(pen.choices[0].logprobs.tokens)) > len(set(tokens))
    rep = client.completions.create(
        prompt="aaaa", max_tokens=24, logprobs=0, model=MODEL, temperature=0.0,
        extra_body={"ignore_eos": True, "repetition_penalty": 5.0})
    assert rep.choices[0].logprobs.tokens != tokens


def test_seeded_penalised_requests_are_exact_under_batching(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "seed me", "max_tokens": 8, "temperature": 1.0,
          "seed": 5, "presence_penalty": 1.0, "logit_bias": {"65": 3.0},
          "extra_body": {"ignore_eos": True, "repetition_penalty": 1.2}}
    alone = client.completions.create(**kw).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(client.completions.create, model=MODEL, prompt=f"other {i}",
                              max_tokens=8, temperature=1.0) for i in range(5)]
        mine = pool.submit(client.completions.create, **kw)
        assert mine.result().choices[0].text == alone
        for f in others:
            f.result()


def test_stop_string_across_token_boundaries_with_n(client: openai.OpenAI) -> None:
    full = client.completions.create(prompt="stop", max_tokens=12, logprobs=0, **GREEDY)
    tokens = full.choices[0].logprobs.tokens
    text = full.choices[0].text
    assert len(tokens) >= 6
    start = len("".join(tokens[:3])) - 1  # the last char of token 3 and the first of token 4
    stop = text[start:start + 2]
    cut = client.completions.create(prompt="stop", max_tokens=12, stop=[stop], n=2, **GREEDY)
    for c in cut.choices:
        assert c.finish_reason == "stop" and c.text == text[:text.index(stop)]


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("c", {"presence_penalty": 2.5}, "presence_penalty"),
        ("c", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("c", {"repetition_penalty": 0.0}, "repetition_penalty"),
        ("c", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("c", {"logit_bias": {"tok": 1}}, "logit_bias"),
        ("c", {"logit_bias": {"256": 1}}, "logit_bias"),
        ("c", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("c", {"logprobs": 21}, "logprobs"),
        ("c", {"n": 0}, "n"),
        ("c", {"n": 33}, "n"),
        ("c", {"n": 3, "best_of": 2}, "best_of"),
        ("c", {"n": 1, "best_of": 2, "stream": True}, "best_of"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("chat", {"top_logprobs": 2}, "top_logprobs"),
        ("chat", {"frequency_penalty": 3}, "frequency_penalty"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(
    server: Proc, path: str, fields: dict[str, Any], param: str
) -> None:
    if path == "c":
        url, body = "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}
    else:
        url = "/v1/chat/completions"
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    r = httpx.post(server.url + url, json={**body, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
