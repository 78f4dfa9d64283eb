"""ModelRunner: persistent input buffers, padding, dummy batches, the graph-runner hook."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_engine

from atom.engine import LLMEngine, SamplingParams, model_runner
from atom.engine.batch import PENDING_TOKEN, SeqRows, StepBatch
from atom.engine.sequence import Sequence
from atom.utils.forward_context import StepKind, StepPlan, get_forward_context


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return tiny_engine(warmup=False, model="tiny-qwen3", max_model_len=64, num_kv_blocks=32,
                       max_num_seqs=8, seed=5)


def _seqs(engine: LLMEngine, prompts: list[list[int]], decode: bool) -> list[Sequence]:
    """Sequences with blocks; when decode, their prompt is already computed but the last token."""
    out = []
    for i, p in enumerate(prompts):
        s = Sequence(str(i), p, SamplingParams())
        engine.block_manager.grow(s, len(p))
        s.num_computed_tokens = len(p) - 1 if decode else 0
        s.num_scheduled_tokens = 1 if decode else len(p)
        out.append(s)
    return out


def _free(engine: LLMEngine, seqs: list[Sequence]) -> None:
    for s in seqs:
        engine.block_manager.free(s)


def _forward(engine: LLMEngine, prepared) -> torch.Tensor:
    ids, _, meta, ctx = prepared
    with engine.runner.step_context(meta, ctx), torch.inference_mode():
        logits, _ = engine.runner.run_model(ids)
    return logits


def test_prefill_padding_rows(engine: LLMEngine) -> None:
    seqs = _seqs(engine, [[1, 2, 3], [4, 5]], decode=False)
    ids, pos, meta, ctx = engine.runner.prepare_inputs(StepBatch.of(seqs, True), pad_to_rows=8,
                                                       pad_to_seqs=4)
    assert ids.tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 0, 0]
    assert meta.slot_mapping[5:].tolist() == [-1, -1, -1]
    assert meta.cu_seqlens_q.tolist() == [0, 3, 5, 5, 5]
    assert meta.context_lens.tolist() == [3, 2, 0, 0]
    assert (meta.num_seqs, meta.num_rows, meta.max_seqlen_q) == (2, 5, 3)
    assert (ctx.is_prefill, ctx.batch_size, ctx.running_bs, ctx.running_tokens) == (True, 2, 4, 8)
    b = engine.block_manager.block_size
    assert meta.slot_mapping[:3].tolist() == [seqs[0].block_table[0] * b + i for i in range(3)]
    _free(engine, seqs)


def test_padded_decode_matches_unpadded_and_stays_in_place(engine: LLMEngine) -> None:
    prompts = [[1, 9, 8, 7], [1, 3, 3, 3, 3, 3, 3]]
    seqs = _seqs(engine, prompts, decode=False)
    _forward(engine, engine.runner.prepare_inputs(StepBatch.of(seqs, True)))  # fill the cache
    for s in seqs:
        s.num_computed_tokens = s.num_tokens - 1
        s.num_scheduled_tokens = 1
    before = engine.runner.kv_cache.clone()
    plain = _forward(engine, engine.runner.prepare_inputs(StepBatch.of(seqs, False)))
    ptrs = {k: v.data_ptr() for k, v in engine.runner.forward_vars.items()}
    ids, pos, meta, ctx = engine.runner.prepare_inputs(StepBatch.of(seqs, False), pad_to_seqs=5)
    assert meta.context_lens.tolist() == [4, 7, 0, 0, 0]
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3, 4, 5]
    assert meta.slot_mapping.tolist()[2:] == [-1, -1, -1] and ids.shape[0] == 5
    assert (ctx.batch_size, ctx.running_bs, ctx.running_tokens) == (2, 5, 5)
    padded = _forward(engine, (ids, pos, meta, ctx))
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded[:2], plain)
    # the same buffers every step (a recorded graph reads these addresses)
    assert {k: v.data_ptr() for k, v in engine.runner.forward_vars.items()} == ptrs
    # decode rewrote only the two real rows' slots (same values): padding wrote nothing
    torch.testing.assert_close(engine.runner.kv_cache, before)
    _free(engine, seqs)


def test_dummy_decode_writes_only_the_reserved_block(engine: LLMEngine) -> None:
    runner = engine.runner
    runner.kv_cache[:, :, : runner.dummy_block].normal_()
    before = runner.kv_cache.clone()
    ids, pos, meta, ctx = runner.build_dummy_decode(4, q_len=2)
    assert ids.shape[0] == 8 and meta.block_tables[:, 0].tolist() == [runner.dummy_block] * 4
    logits = _forward(engine, (ids, pos, meta, ctx))
    assert torch.isfinite(logits).all()
    changed = (runner.kv_cache != before).flatten(3).any(-1)  # [2, layers, blocks]
    assert changed[:, :, runner.dummy_block].all()
    assert not changed[:, :, : runner.dummy_block].any()


class _FakeGraphRunner:
    def __init__(self, out: torch.Tensor | None) -> None:
        self.out, self.calls = out, 0

    def plan(self, is_prefill, num_seqs, num_tokens, q_len=1, verify_rows=1) -> StepPlan:
        # decode steps padded to 4 sequences, prefill steps eager
        if is_prefill:
            return StepPlan(StepKind.EAGER, num_tokens, num_seqs)
        return StepPlan(StepKind.REQ_GRAPH, 4, 4, key=(4, 0))

    def maybe_replay(self, runner, input_ids):
        self.calls += 1
        fctx = get_forward_context()
        assert fctx.context.running_bs == input_ids.shape[0] == fctx.plan.rows  # as planned
        return None if self.out is None else self.out[: input_ids.shape[0]]

    def capture(self, runner):
        return 1.5, [1, 2, 4]


def test_graph_runner_hook(engine: LLMEngine) -> None:
    runner = engine.runner
    assert runner.capture_cudagraph() == (0.0, [])
    hidden = torch.zeros(16, engine.hf_config.hidden_size)
    hidden[:, 0] = 1.0
    try:
        runner.graph_runner = _FakeGraphRunner(hidden)
        assert runner.capture_cudagraph() == (1.5, [1, 2, 4])
        seqs = _seqs(engine, [[1, 2], [3, 4]], decode=True)
        logits, sampled = runner.execute_model(StepBatch.of(seqs, False))
        assert runner.graph_runner.calls == 1 and len(sampled) == 2
        # replayed hidden states feed the logits
        torch.testing.assert_close(logits, runner.model.compute_logits(hidden[:2]))
        runner.graph_runner = _FakeGraphRunner(None)  # declines: eager
        logits2, _ = runner.execute_model(StepBatch.of(seqs, False))
        assert not torch.allclose(logits2, logits)
        _free(engine, seqs)
    finally:
        runner.graph_runner = None


def test_logits_rows_count_for_leading_rows_else_indices(engine: LLMEngine) -> None:
    """Decode steps sample their first rows in order: run_model takes a count (a view of the
    hidden states); other steps an index tensor. Both give the same logits for those rows."""
    runner = engine.runner
    assert runner.logits_rows([0, 1, 2]) == 3
    assert runner.logits_rows([]) == 0
    idx = runner.logits_rows([2, 4])
    assert isinstance(idx, torch.Tensor) and idx.tolist() == [2, 4]
    seqs = _seqs(engine, [[1, 9, 8, 7], [1, 3, 3]], decode=True)
    ids, _, meta, ctx = runner.prepare_inputs(StepBatch.of(seqs, False), pad_to_rows=4, pad_to_seqs=4)
    with runner.step_context(meta, ctx), torch.inference_mode():
        by_count, hidden = runner.run_model(ids, runner.logits_rows([0, 1]))
        by_index, _ = runner.run_model(ids, torch.tensor([0, 1]))
    assert by_count.shape == (2, by_count.shape[1]) and hidden.shape[0] == 4
    assert torch.equal(by_count, by_index)
    _free(engine, seqs)


def _reference_rows(batch: StepBatch, bs: int, pad_rows: int, pad_seqs: int,
                    pending: list[int]) -> dict[str, list]:
    """The step's inputs computed row by row, token by token (what prepare_inputs did before
    it used numpy columns), with placeholders already replaced by their pending tokens."""
    ids, pos, slots, q_lens, ctx = [], [], [], [], []
    for s in batch.seqs:
        toks = list(s.token_ids)
        if s.pending_src is not None and toks and toks[-1] == PENDING_TOKEN:
            toks[-1] = pending[s.pending_src]
        ids += toks
        pos += range(s.start, s.start + len(toks))
        slots += [s.block_table[p // bs] * bs + p % bs for p in range(s.start, s.start + len(toks))]
        q_lens.append(len(toks))
        ctx.append(s.start + len(toks))
    n = len(q_lens)
    if batch.is_prefill:
        rows, nseq, q_pad = max(len(ids), pad_rows), max(n, pad_seqs), 0
    else:
        q_pad = max(q_lens, default=1)
        nseq = max(n, pad_seqs, -(-pad_rows // q_pad))
        rows = max(len(ids), nseq * q_pad)
    pad = rows - len(ids)
    q_lens += [q_pad] * (nseq - n)
    ctx += [0] * (nseq - n)
    return {"ids": ids + [0] * pad, "pos": pos + [0] * pad, "slots": slots + [-1] * pad,
            "cu_q": [sum(q_lens[:i]) for i in range(nseq + 1)],
            "cu_k": [sum(ctx[:i]) for i in range(nseq + 1)], "ctx": ctx,
            "max_q": max(q_lens, default=0), "max_k": max(ctx, default=0)}


# SMALL_BATCH_ROWS: every step row by row, or every step with numpy
BY_ROW_OR_COLUMN = [pytest.param(1 << 30, id="by-row"), pytest.param(0, id="by-column")]


@pytest.mark.parametrize("small_rows", BY_ROW_OR_COLUMN)
def test_prepare_inputs_matches_the_row_by_row_reference(
        engine: LLMEngine, small_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random prefill chunks, decode steps (1 or 3 rows a sequence, some with a pending last
    token) and paddings: both ways of preparing a step stage exactly the reference's values,
    and every sequence's blocks."""
    monkeypatch.setattr(model_runner, "SMALL_BATCH_ROWS", small_rows)
    rng = random.Random(11)
    runner, bs = engine.runner, engine.block_manager.block_size
    pending = [1000 + j for j in range(8)]
    tokens = torch.tensor(pending)
    for trial in range(40):
        prefill = trial % 2 == 0
        q = 1 if prefill or trial % 4 == 1 else 3
        rows = []
        for i in range(rng.randrange(1, 5)):
            start = rng.randrange(0, 40)
            n = rng.randrange(1, 9) if prefill else q
            table = rng.sample(range(runner.num_kv_blocks), (start + n + bs - 1) // bs)
            toks = [rng.randrange(3, 200) for _ in range(n)]
            src = i if not prefill and rng.random() < 0.6 else None
            if src is not None:
                toks[-1] = PENDING_TOKEN
            rows.append(SeqRows(str(i), toks, start, table, src, True))
        batch = StepBatch(rows, prefill)
        pad_rows, pad_seqs = rng.choice([0, 0, 8]), rng.choice([0, 6])
        ids, pos, meta, ctx = runner.prepare_inputs(batch, pad_rows, pad_seqs, tokens)
        ref = _reference_rows(batch, bs, pad_rows, pad_seqs, pending)
        assert ids.tolist() == ref["ids"] and pos.tolist() == ref["pos"]
        assert meta.slot_mapping.tolist() == ref["slots"]
        assert meta.cu_seqlens_q.tolist() == ref["cu_q"] and meta.cu_seqlens_k.tolist() == ref["cu_k"]
        assert meta.context_lens.tolist() == ref["ctx"]
        assert (meta.max_seqlen_q, meta.max_seqlen_k) == (ref["max_q"], ref["max_k"])
        assert (meta.num_seqs, meta.num_rows) == (len(rows), sum(len(r.token_ids) for r in rows))
        for i, r in enumerate(rows):
            assert meta.block_tables[i, : len(r.block_table)].tolist() == r.block_table
        # the same batch from its columns (StepBatch.of's form) stages the same rows
        again = runner.prepare_inputs(StepBatch(None, prefill, rows=batch.rows), pad_rows,
                                      pad_seqs, tokens)
        assert again[0].tolist() == ref["ids"] and again[2].slot_mapping.tolist() == ref["slots"]


@pytest.mark.parametrize("small_rows", BY_ROW_OR_COLUMN)
def test_prepare_inputs_refuses_a_stray_device_token_and_a_short_block_table(
        engine: LLMEngine, small_rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_runner, "SMALL_BATCH_ROWS", small_rows)
    runner = engine.runner
    stray = SeqRows("odd", [PENDING_TOKEN, 5], 0, [1], 0, True)  # pending, but not its last
    with pytest.raises(ValueError, match="'odd'.*still on the device"):
        runner.prepare_inputs(StepBatch([stray], True), pending_tokens=torch.tensor([7]))
    short = SeqRows("short", [5], engine.block_manager.block_size, [1], None, True)
    with pytest.raises(IndexError, match="'short'"):
        runner.prepare_inputs(StepBatch([short], False))
