"""bench/copy_chain.py: the token-chain model spec_bench's copy workload runs on. On tiny-llama
(CPU) its greedy answers follow the chain and the n-gram drafter's tokens are identical with
a high acceptance; for the llama-3.2-1b shape the construction's bf16 logit margin, computed
from a random embedding of the real size (every chain token, the whole vocabulary)."""

from __future__ import annotations

import argparse
import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

from atom.engine import LLMEngine, SamplingParams
from atom.models.registry import load_model_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from copy_chain import Chain, ChainWeights, copy_prompts, margin  # noqa: E402
from spec_bench import build_engine, to_chain  # noqa: E402

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
MAX_TOKENS = 28
QUICK = argparse.Namespace(  # spec_bench --quick's engine settings
    model="tiny-llama",
    level=0,
    mode="NONE",
    batches=[1, 2],
    dtype="float32",
    device="cpu",
    max_model_len=128,
    num_kv_blocks=64,
)


def _chain_engine(spec: dict | None, chain: Chain) -> tuple[LLMEngine, dict]:
    """An engine as spec_bench --quick builds it, made the chain model as its copy workload
    does."""
    e = build_engine(QUICK, spec)
    params = {n: p.data_ptr() for n, p in e.runner.model.named_parameters()}
    report = to_chain(e, chain)["target"]
    # In place: the same tensors, which compiled code and graphs keep reading.
    assert {n: p.data_ptr() for n, p in e.runner.model.named_parameters()} == params
    return e, report


@pytest.fixture(scope="module")
def chain() -> Chain:
    return Chain.draw(256, 64, 0, {1, 2})


def test_copy_prompts_repeat_a_span_after_a_break(chain: Chain) -> None:
    prompts, expected = copy_prompts(chain, 3, MAX_TOKENS, seed=5)
    for p, want in zip(prompts, expected, strict=True):
        span, brk = p[: MAX_TOKENS + 32], p[MAX_TOKENS + 32 : -4]
        assert p[-4:] == span[:4] and len(brk) == 8
        assert span[1:] == chain.continuation(span[0], len(span) - 1)
        joins = [span[-1], *brk, span[0]]
        assert all(chain.succ(a) != b for a, b in pairwise(joins))  # the chain is broken
        assert want == span[4 : 4 + MAX_TOKENS]  # the answer is a span of the prompt


def test_chain_model_follows_succ_and_ngram_accepts(chain: Chain) -> None:
    base, report = _chain_engine(None, chain)
    assert report["wrong"] == [] and report["min_gap"] > 0
    prompts, expected = copy_prompts(chain, 2, MAX_TOKENS, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert base.generate(prompts, greedy) == expected
    # Any chain token, no prompt to copy from: the model itself follows succ.
    start = [[chain.tokens[10]], [chain.tokens[50], chain.tokens[3]]]
    assert base.generate(start, greedy) == [chain.continuation(p[-1], MAX_TOKENS) for p in start]
    del base

    ngram, _ = _chain_engine(NGRAM, chain)
    before = ngram.stats()
    assert ngram.generate(prompts, greedy) == expected
    after = ngram.stats()
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and accepted / drafted > 0.8


@pytest.mark.slow
def test_chain_margin_bf16_llama_1b_shape() -> None:
    """The 1B shape's construction on a dummy-like embedding (N(0, 0.02), as
    atom.models.loader.init_dummy_weights draws it) in bf16: every chain token's successor
    wins, by far more than bf16's resolution of the logits (0.25 near 38)."""
    hf = load_model_config("llama-3.2-1b")
    gen = torch.Generator().manual_seed(0)
    embed = torch.empty(hf.vocab_size, hf.hidden_size, dtype=torch.bfloat16)
    embed.normal_(0.0, 0.02, generator=gen)
    chain = Chain.draw(hf.vocab_size, 2048, 0, {*hf.eos_token_id, hf.bos_token_id})
    report = margin(ChainWeights.build(embed, chain, hf.rms_norm_eps), chain)
    assert report["wrong"] == []
    assert report["min_gap"] > 16 and report["min_gap"] > 0.5 * report["min_succ_logit"]
