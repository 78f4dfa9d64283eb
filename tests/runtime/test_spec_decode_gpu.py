"""Speculative decoding on CUDA in bf16 (skipped without it): a verify step's rows are decode
rows, bit for bit.

A verify of bs requests runs bs * (k + 1) one-token decode rows whose kernels launch for the
bs requests (atom.utils.forward_context.launch_rows), so each row's logits must equal, bit for
bit, those of a plain decode step of the bs requests at that position: 1 request in 4 rows,
2 in 8, 8 in 32 (past the 16 rows the GEMV kernels take, in blocks of 16), with contexts long
enough that the decode attention splits its keys. Then a self-draft accepts every draft and
the greedy tokens equal those without speculation.

    PYTHONPATH=runtime .venv/bin/pytest tests/runtime/test_spec_decode_gpu.py -m gpu -v
"""

from __future__ import annotations

import random

import pytest
import torch
from test_spec_decode import _engine as engine_of
from test_spec_decode_verify import decode_each_position

from atom.config import CompilationConfig
from atom.engine import LLMEngine, SamplingParams
from atom.engine.batch import SeqRows, StepBatch
from atom.engine.sequence import Sequence
from atom.spec_decode.decoder import verify_batch
from atom.utils.counters import counters
from atom.utils.forward_context import SpecDecodeMetadata

pytestmark = pytest.mark.gpu

K = 3
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _engine(model: str, mode: str, spec: dict | None, level: int = 0) -> LLMEngine:
    # test_spec_decode's CPU engine, on CUDA in bf16 with long contexts. Eager: NONE; FULL and
    # TR_HYBRID record buckets 1, 2, 4, 8 (a verify's: x (k + 1) rows).
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8])
    return engine_of(
        spec,
        model=model,
        dtype="bfloat16",
        device="cuda",
        max_model_len=4096,
        max_num_seqs=8,
        num_kv_blocks=2048,
        enable_prefix_caching=False,
        compilation_config=cc,
    )


def _prompts(bs: int, vocab: int) -> list[list[int]]:
    """Contexts of 40 to 3000 tokens (prompts over the largest token bucket, 32 rows: both
    engines prefill them eagerly alike)."""
    rng = random.Random(bs)
    lengths = [3000, 40, 700, 1500, 64, 2100, 333, 90][:bs]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _sequences(e: LLMEngine, prompts: list[list[int]]) -> list[Sequence]:
    """Sequences with room for K more tokens, their prompts but the last token prefilled
    (one at a time: the same prefills in either engine)."""
    seqs = [Sequence(str(i), p, GREEDY) for i, p in enumerate(prompts)]
    for s in seqs:
        e.block_manager.grow(s, s.num_tokens + K)
        rows = SeqRows(s.request_id, s.token_ids[:-1], 0, s.block_table, None, False)
        e.runner.execute_model(StepBatch([rows], is_prefill=True))
    return seqs


# Measured on the H200 on 2026-12-02 (commit 8d44b49): llama-3.2-1b's verify rows equal its
# decode rows bit for bit in every mode; tiny-llama's do not (its shapes take other kernel
# plans), and at level 3 the self-draft does not accept every draft. Open in issue 30; strict,
# so a fix shows up as an XPASS failure and the marks come off.
KNOWN_BF16_GAP = pytest.mark.xfail(
    strict=True, reason="H200 2026-12-02: bf16 verify rows differ from decode rows (issue 30)"
)


@pytest.mark.parametrize("model", [pytest.param("tiny-llama", marks=KNOWN_BF16_GAP),
                                   "llama-3.2-1b"])
@pytest.mark.parametrize("mode", ["NONE", "FULL", "TR_HYBRID"])
def test_verify_rows_equal_decode_rows_bit_for_bit(model: str, mode: str) -> None:
    plain, spec = _engine(model, mode, None), _engine(model, mode, NGRAM)
    vocab = plain.hf_config.vocab_size
    diffs = []
    for bs in (1, 2, 8):
        prompts = _prompts(bs, vocab)
        rng = random.Random(100 + bs)
        drafts = [[rng.randrange(3, vocab) for _ in range(K)] for _ in range(bs)]
        seqs = _sequences(plain, prompts)
        want = decode_each_position(plain.runner, seqs, drafts)
        vseqs = _sequences(spec, prompts)
        meta = SpecDecodeMetadata(num_draft_tokens=[K] * bs)
        with counters.track() as d:
            got, _ = spec.runner.execute_model(verify_batch(vseqs, drafts), spec=meta)
        torch.cuda.synchronize()
        if mode != "NONE":
            assert d.get("verify_graph_replays") == 1 and not d.get("eager_steps"), (bs, d)
        for r in range(bs):
            for i in range(K + 1):
                a, b = got[r * (K + 1) + i], want[i][r]
                if not torch.equal(a, b):
                    diffs.append((bs, r, i, float((a.float() - b.float()).abs().max())))
        for s in seqs:
            plain.block_manager.free(s)
        for s in vseqs:
            spec.block_manager.free(s)
    assert not diffs, f"(batch, request, row, max |diff|) not bitwise equal: {diffs}"


@KNOWN_BF16_GAP
@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_self_draft_accepts_everything_in_bf16(mode: str) -> None:
    """The target as its own draft, bf16, level 3: every draft accepted, the greedy tokens
    those without speculation; every verify replays a (bs, k) recording and the draft's
    passes DraftGraphs."""
    self_spec = {"method": "draft_model", "model": "llama-3.2-1b", "num_speculative_tokens": K}
    base = _engine("llama-3.2-1b", mode, None, level=3)
    prompts = _prompts(4, base.hf_config.vocab_size)[1:]  # 40 .. 1500 tokens
    want = base.generate(prompts, GREEDY)
    e = _engine("llama-3.2-1b", mode, self_spec, level=3)
    with counters.track() as d:
        got = e.generate(prompts, GREEDY)
    st = e.stats()
    assert got == want
    assert st["spec_decode_acceptance_rate"] == 1.0, st
    assert d["verify_graph_replays"] == d["spec_verify_steps"] > 0
    assert d["draft_graph_replays"] >= K * d["spec_verify_steps"]
