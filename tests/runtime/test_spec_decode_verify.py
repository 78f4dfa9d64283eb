"""The verify forward as a decode step (CPU): each request's k + 1 rows are one-token decode
rows sharing its block table (atom.spec_decode.decoder), their logits are those of decoding
the same tokens one at a time, the buckets keep the guide's (running_bs, draft_num) key, the
draft model's k passes share one preparation, and no decode forward of either runner runs
eagerly once graphs are recorded (CUDA capture emulated)."""

from __future__ import annotations

import pytest
import torch
from test_spec_decode import GREEDY, LONG, NGRAM, ONE, SELF, SHORT, _config, _engine

from atom.config import CompilationConfig, CUDAGraphMode
from atom.cudagraph.region_graph import request_bucket
from atom.engine import LLMEngine, SamplingParams
from atom.engine.batch import SeqRows, StepBatch
from atom.engine.sequence import Sequence
from atom.spec_decode.decoder import verify_batch
from atom.spec_decode.draft_model import advance_decode_rows
from atom.utils.forward_context import (
    AttentionMetaData,
    SpecDecodeMetadata,
    StepKind,
    get_forward_context,
)


@pytest.fixture(scope="module")
def ref() -> LLMEngine:
    return _engine()


def _spy_forwards(runner) -> list[dict]:
    """Every forward of the runner: its metadata and context, as the layers read them."""
    seen: list[dict] = []
    inner = runner.run_model

    def run_model(input_ids, logits_indices=None):
        f = get_forward_context()
        md, ctx = f.attn_metadata, f.context
        seen.append(
            dict(
                verify=f.spec_decode_metadata is not None,
                prefill=ctx.is_prefill,
                rows=int(input_ids.shape[0]),
                max_q=md.max_seqlen_q,
                verify_rows=md.verify_rows,
                key=request_bucket(ctx.running_bs, md.request_q_len),
                running_tokens=ctx.running_tokens,
                batch_size=ctx.batch_size,
                positions=ctx.positions[: md.num_rows].tolist(),
                context_lens=md.context_lens[: md.num_seqs].tolist(),
                tables=md.block_tables[: md.num_seqs].tolist(),
            )
        )
        return inner(input_ids, logits_indices)

    runner.run_model = run_model
    return seen


def test_verify_is_a_decode_step_of_expanded_rows(ref: LLMEngine) -> None:
    """Mixed short and long requests: every verify forward is a pure decode step of
    bs * (k + 1) one-token rows, row i of a request at position base + i with context
    base + i + 1 and the request's block table; its bucket key is (bs, k)."""
    k = 3
    e = _engine(NGRAM)
    seen = _spy_forwards(e.runner)
    prompts = [SHORT, LONG, ONE, LONG[:9]]
    assert e.generate(prompts, GREEDY) == ref.generate(prompts, GREEDY)
    verifies = [s for s in seen if s["verify"]]
    assert len(verifies) == e.stats()["spec_decode_steps"] > 0
    assert any(v["batch_size"] == 4 for v in verifies)
    for v in verifies:
        bs = v["batch_size"]
        assert not v["prefill"] and v["max_q"] == 1 and v["verify_rows"] == k + 1
        assert v["rows"] == v["running_tokens"] == bs * (k + 1)  # eager on the CPU: no padding
        assert v["key"] == (bs, k)
        for r in range(bs):
            pos = v["positions"][r * (k + 1) : (r + 1) * (k + 1)]
            base = pos[0]
            assert pos == list(range(base, base + k + 1))
            assert v["context_lens"][r * (k + 1) : (r + 1) * (k + 1)] == [p + 1 for p in pos]
            # the blocks the rows read (past them a row keeps earlier steps' entries)
            nb = -(-(pos[-1] + 1) // e.config.block_size)
            tables = [t[:nb] for t in v["tables"][r * (k + 1) : (r + 1) * (k + 1)]]
            assert all(t == tables[0] for t in tables)
    assert e.stats()["kv_blocks_used"] == 0


def _prefill(runner, seq: Sequence) -> None:
    """The sequence's tokens but the last into the cache."""
    n = seq.num_tokens - 1
    rows = SeqRows(seq.request_id, seq.token_ids[:n], 0, seq.block_table, None, False)
    runner.execute_model(StepBatch([rows], is_prefill=True))


def decode_each_position(runner, seqs: list[Sequence], drafts: list[list[int]]) -> list:
    """Logits of plain decode steps of the requests, one per position a verify of these
    drafts covers: step i decodes each request's token at base + i (its last, then drafts)."""
    want = []
    for i in range(len(drafts[0]) + 1):
        rows = [
            SeqRows(
                s.request_id,
                [([s.token_ids[-1]] + d)[i]],
                s.num_tokens - 1 + i,
                s.block_table,
                None,
                True,
            )
            for s, d in zip(seqs, drafts, strict=True)
        ]
        logits, _ = runner.execute_model(StepBatch(rows, is_prefill=False))
        want.append(logits[: len(seqs)].clone())
    return want


def test_verify_rows_logits_are_those_of_decoding_one_token_at_a_time() -> None:
    """Two requests (short and long) verify 3 drafts each: row i's logits equal those of the
    plain decode step of both requests at position base + i (every row sees the drafts
    before it)."""
    e = _engine(NGRAM)
    runner, bm, k = e.runner, e.block_manager, 3
    seqs = [Sequence("a", SHORT, GREEDY), Sequence("b", LONG[:30], GREEDY)]
    drafts = [[7, 8, 9], [40, 41, 40]]
    for s in seqs:
        bm.grow(s, s.num_tokens + k)
        _prefill(runner, s)
    want = decode_each_position(runner, seqs, drafts)
    spec = SpecDecodeMetadata(num_draft_tokens=[k, k])
    got, sampled = runner.execute_model(verify_batch(seqs, drafts), spec=spec)
    assert got.shape[0] == len(sampled) == 2 * (k + 1)
    for r in range(2):
        for i in range(k + 1):
            torch.testing.assert_close(got[r * (k + 1) + i], want[i][r], rtol=1e-5, atol=1e-5)
    for s in seqs:
        bm.free(s)


@pytest.mark.parametrize("k", [0, 1, 3])
def test_bucket_keys_of_the_expanded_rows(k: int) -> None:
    """request_bucket(running_bs, max_seqlen_q) == (running_bs, draft_num): a verify step of
    3 requests pads to the (4, k) bucket of 4 * (k + 1) rows, its context counting requests;
    k = 0 is the plain decode step."""
    from cpu_recorder import CpuOpRecorder

    from atom.cudagraph.runner import GraphRunner

    cc = CompilationConfig(level=0, cudagraph_mode="FULL", cudagraph_capture_sizes=[1, 2, 4])
    spec = {**NGRAM, "num_speculative_tokens": k} if k else None
    cfg = _config(spec, compilation_config=cc)
    e = LLMEngine(cfg)
    e.runner.graph_runner = GraphRunner(cfg, recorder_factory=CpuOpRecorder, q_len=k + 1)
    e.warmup()
    gr = e.runner.graph_runner
    plain = [(1, 0), (2, 0), (4, 0)] if k else []  # FULL also records plain decode buckets
    assert gr.req_graph.keys() == sorted([(1, k), (2, k), (4, k)] + plain)
    rows = [SeqRows(str(i), [5], 3 + i, [0], None, True) for i in range(3 * (k + 1))]
    meta = SpecDecodeMetadata(num_draft_tokens=[k] * 3) if k else None
    step = e.runner.prepare_step(StepBatch(rows, is_prefill=False), spec=meta)
    plan, md, ctx = step.plan, step.meta, step.context
    assert (plan.kind, plan.key, plan.rows, plan.seqs) == (
        StepKind.REQ_GRAPH, (4, k), 4 * (k + 1), 4 * (k + 1))
    assert step.input_ids.shape[0] == plan.rows
    assert (ctx.batch_size, ctx.running_bs, ctx.running_tokens) == (3, 4, 4 * (k + 1))
    assert (md.max_seqlen_q, md.verify_rows, md.request_q_len) == (1, k + 1, k + 1)
    assert request_bucket(ctx.running_bs, md.request_q_len) == (4, k)
    assert md.context_lens[3 * (k + 1) :].tolist() == [0] * (k + 1)  # a padding request
    assert AttentionMetaData(max_seqlen_q=1).request_q_len == 1


def test_draft_passes_share_one_preparation() -> None:
    """The draft model's k passes are prepared once: passes 2..k move the rows one position
    on, on the device, to exactly what preparing them afresh gives."""
    e = _engine(SELF)
    runner = e.draft_runner
    calls = []
    inner = runner.prepare_inputs
    runner.prepare_inputs = lambda *a, **kw: calls.append(a[0].is_prefill) or inner(*a, **kw)
    e.generate([SHORT, LONG], GREEDY)
    st = e.stats()
    # one decode preparation per step, one more per step after a fully accepted one (catch-up)
    steps = st["spec_decode_steps"]
    assert st["spec_decode_acceptance_rate"] == 1.0
    assert steps <= calls.count(False) <= 2 * steps
    seqs = [Sequence("a", SHORT, GREEDY), Sequence("b", LONG[:20], GREEDY)]
    for s in seqs:
        e.block_manager.grow(s, s.num_tokens + 2)

    def rows(shift: int, toks: list[int]) -> StepBatch:
        return StepBatch(
            [
                SeqRows(s.request_id, [t], s.num_tokens - 1 + shift, s.block_table, None, True)
                for s, t in zip(seqs, toks, strict=True)
            ],
            is_prefill=False,
        )

    with torch.inference_mode():
        ids, pos, md, _ = runner.prepare_inputs(rows(0, [1, 1]), pad_to_seqs=4)
        advance_decode_rows(ids[:2], pos[:2], md, torch.tensor([9, 11]), runner.block_size)
        got = [t.clone() for t in (ids, pos, md.context_lens, md.slot_mapping, md.cu_seqlens_k)]
        ids, pos, md2, _ = runner.prepare_inputs(rows(1, [9, 11]), pad_to_seqs=4)
        want = (ids, pos, md2.context_lens, md2.slot_mapping, md2.cu_seqlens_k)
    for g, w in zip(got, want, strict=True):
        assert g.tolist() == w.tolist()
    assert md.max_seqlen_k == md2.max_seqlen_k
    for s in seqs:
        e.block_manager.free(s)


@pytest.mark.parametrize("mode", [
    CUDAGraphMode.FULL, pytest.param(CUDAGraphMode.TR_HYBRID, marks=pytest.mark.slow)
])  # FULL keeps the check in the fast tier; TR_HYBRID's capture adds 20 s
def test_no_decode_forward_runs_eagerly(ref: LLMEngine, mode: CUDAGraphMode) -> None:
    """Emulated capture: every verify forward replays a (bs, k) recording and every draft
    decode pass (the k passes and the catch-up) a DraftGraph; only prefills run eagerly."""
    from cpu_recorder import CpuOpRecorder

    from atom.cudagraph.runner import GraphRunner
    from atom.spec_decode.draft_graph import DraftGraph
    from atom.utils.counters import counters

    k = 3
    cc = CompilationConfig(level=0, cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4])
    cfg = _config(SELF, compilation_config=cc)
    e = LLMEngine(cfg)
    e.runner.graph_runner = GraphRunner(cfg, recorder_factory=CpuOpRecorder, q_len=k + 1)
    e.draft_runner.graph_runner = GraphRunner(
        e.draft_runner.config,
        recorder_factory=CpuOpRecorder,
        is_draft=True,
        req_graph_cls=DraftGraph,
    )
    e.warmup()
    eager: list[tuple[str, bool]] = []
    for name, runner in (("target", e.runner), ("draft", e.draft_runner)):
        inner = runner.graph_runner.maybe_replay

        def maybe_replay(r, ids, inner=inner, name=name):
            out = inner(r, ids)
            if out is None:
                eager.append((name, get_forward_context().context.is_prefill))
            return out

        runner.graph_runner.maybe_replay = maybe_replay
    prompts = [SHORT, LONG, ONE]
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with counters.track() as d:
        assert e.generate(prompts, p) == ref.generate(prompts, p)
    assert d["verify_graph_replays"] == d["spec_verify_steps"] > 0
    assert d["draft_graph_replays"] > k * d["spec_verify_steps"]  # catch-up passes too
    assert eager and all(prefill for _, prefill in eager), eager
