"""The real server with --speculative-config (self-draft), driven by the official openai
client: greedy text equals the server without speculation, and /metrics and /status report
the drafted and accepted tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_proc import Proc, start_server

SPEC = json.dumps({"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Proc, Proc]]:
    plain = start_server("--max-num-seqs", "8", "--num-kv-blocks", "128")
    spec = start_server(
        "--max-num-seqs", "8", "--num-kv-blocks", "128", "--speculative-config", SPEC
    )
    try:
        plain.wait_healthy()
        spec.wait_healthy()
        yield plain, spec
    finally:
        spec.stop()
        plain.stop()


def _complete(url: str, stream: bool) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        kw = dict(model="tiny-llama", prompt="speculate on this", max_tokens=17, temperature=0)
        if stream:
            return "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **kw))
        return c.completions.create(**kw).choices[0].text


def test_greedy_text_and_metrics(servers: tuple[Proc, Proc]) -> None:
    plain, spec = servers
    want = _complete(plain.url, stream=False)
    assert _complete(spec.url, stream=False) == want
    assert _complete(spec.url, stream=True) == want
    text = httpx.get(spec.url + "/metrics").text
    values = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("atom_spec_decode_")
    }
    assert values["atom_spec_decode_num_draft_tokens_total"] > 0
    assert (
        values["atom_spec_decode_num_accepted_tokens_total"]
        == values["atom_spec_decode_num_draft_tokens_total"]
    )  # self-draft: every greedy draft accepted
    assert values["atom_spec_decode_acceptance_rate"] == 1.0
    status = httpx.get(spec.url + "/status").json()
    assert status["speculative_config"]["num_speculative_tokens"] == 3
    assert status["stats"]["spec_decode_num_draft_tokens"] > 0
    assert "atom_spec_decode_" not in httpx.get(plain.url + "/metrics").text
