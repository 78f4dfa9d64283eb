"""GraphRunner on the CPU: mode resolution, capture-size rules, bucket selection and padding,
and the whole capture/replay flow through the real engine with an emulated recorder."""

from __future__ import annotations

import logging

import pytest

from atom.config import CompilationConfig, Config, CUDAGraphMode
from atom.cudagraph.runner import (
    EAGER,
    REQ_GRAPH,
    TOKEN_GRAPH,
    ForwardMode,
    GraphRunner,
    StepPlan,
    frozen_gc,
    pad_to_bucket,
    resolve_capture_sizes,
    resolve_mode,
)

M = CUDAGraphMode


def _config(mode: CUDAGraphMode | None, device: str = "cuda", **kw) -> Config:
    cc = CompilationConfig(level=kw.pop("level", 0), cudagraph_mode=mode,
                           cudagraph_capture_sizes=kw.pop("sizes", [1, 2, 4]))
    return Config(model="tiny-llama", device=device, max_num_seqs=kw.pop("max_num_seqs", 8),
                  compilation_config=cc, **kw)


# ----------------------------------------------------------------- mode resolution


@pytest.mark.parametrize(
    ("mode", "expected"),
    [(M.NONE, M.NONE), (M.TR_HYBRID, M.TR_HYBRID), (M.FULL, M.FULL),
     (M.FULL_DECODE_ONLY, M.FULL_DECODE_ONLY), (M.FULL_AND_TR_HYBRID, M.TR_HYBRID)],
)
def test_mode_resolution_with_cuda(mode: CUDAGraphMode, expected: CUDAGraphMode) -> None:
    assert resolve_mode(_config(mode), cuda_available=True) == expected


@pytest.mark.parametrize("mode", [M.TR_HYBRID, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_TR_HYBRID])
def test_every_mode_is_none_without_cuda_with_one_warning(
    mode: CUDAGraphMode, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="atom.cudagraph.runner"):
        runner = GraphRunner(_config(mode, device="cpu"), cuda_available=False)
    assert runner.mode == M.NONE and not runner.active
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and mode.name in warnings[0].getMessage()


def test_none_enforce_eager_and_use_cudagraph_off_resolve_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert resolve_mode(_config(M.NONE, device="cpu"), cuda_available=False) == M.NONE
        assert resolve_mode(_config(M.FULL, enforce_eager=True), cuda_available=True) == M.NONE
        cfg = _config(M.FULL)
        cfg.compilation_config.use_cudagraph = False
        assert resolve_mode(cfg, cuda_available=True) == M.NONE
    assert not caplog.records


def test_decode_and_mixed_modes() -> None:
    r = GraphRunner(_config(M.FULL_DECODE_ONLY), cuda_available=True)
    assert (r.decode_mode, r.mixed_mode) == (M.FULL, M.NONE)
    r = GraphRunner(_config(M.FULL_AND_TR_HYBRID), cuda_available=True)
    assert (r.decode_mode, r.mixed_mode) == (M.TR_HYBRID, M.TR_HYBRID)


# ----------------------------------------------------------------- capture sizes


def test_capture_size_rules() -> None:
    # explicit list wins, largest first
    assert resolve_capture_sizes([4, 1, 2], [512], 8) == [4, 2, 1]
    # one value: the guide's pattern, clamped to what the scheduler can produce
    assert resolve_capture_sizes(None, [512], 512) == sorted(
        list(range(1, 9)) + list(range(16, 513, 16)), reverse=True)
    assert resolve_capture_sizes(None, [64], 20) == [16, 8, 7, 6, 5, 4, 3, 2, 1]
    # several values: used as given
    assert resolve_capture_sizes(None, [3, 9, 5], 16) == [9, 5, 3]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes .* max_num_seqs=8"):
        resolve_capture_sizes([16, 1], [512], 8)
    with pytest.raises(ValueError, match="cuda_graph_sizes.* max_num_seqs"):
        resolve_capture_sizes(None, [4, 32], 8)


def test_default_ladder_from_config() -> None:
    cfg = Config(model="tiny-llama", device="cuda",
                 compilation_config=CompilationConfig(level=3))
    r = GraphRunner(cfg, cuda_available=True)
    assert r.mode == M.TR_HYBRID
    sizes = r._sizes()
    assert sizes[0] == 512 and sizes[-1] == 1 and sizes == sorted(sizes, reverse=True)
    assert len(sizes) == 8 + 32


# ----------------------------------------------------------------- bucket selection


def test_pad_to_bucket() -> None:
    assert pad_to_bucket(3, [1, 2, 4, 8]) == 4
    assert pad_to_bucket(4, [1, 2, 4, 8]) == 4
    assert pad_to_bucket(9, [1, 2, 4, 8]) is None
    assert pad_to_bucket(1, []) is None


def _decide(mode: CUDAGraphMode, prefill: bool, seqs: int, tokens: int, q: int = 1):
    return ForwardMode.decide(mode.decode_mode(), mode.mixed_mode(), is_prefill=prefill,
                              num_seqs=seqs, num_tokens=tokens, q_len=q,
                              token_sizes=[1, 2, 4, 8, 16],
                              req_keys=[(1, 0), (2, 0), (4, 0), (8, 0), (2, 1)])


def test_forward_mode_decisions() -> None:
    # FULL: decode pads to the smallest request bucket; prefill and oversize run eagerly
    p = _decide(M.FULL, False, 3, 3)
    assert (p.kind, p.rows, p.seqs, p.key) == (REQ_GRAPH, 4, 4, (4, 0))
    assert _decide(M.FULL, True, 3, 40).kind == EAGER
    assert _decide(M.FULL, False, 9, 9).kind == EAGER
    # multi-row decode (draft tokens) uses the (bs, draft_num) buckets
    p = _decide(M.FULL, False, 2, 4, q=2)
    assert (p.kind, p.rows, p.key) == (REQ_GRAPH, 4, (2, 1))
    assert _decide(M.FULL, False, 3, 6, q=2).kind == EAGER
    # FULL_DECODE_ONLY: mixed batches eager, decode full
    assert _decide(M.FULL_DECODE_ONLY, True, 2, 2).kind == EAGER
    assert _decide(M.FULL_DECODE_ONLY, False, 2, 2).kind == REQ_GRAPH
    # TR_HYBRID: any step whose token count fits a bucket, prefill included
    p = _decide(M.TR_HYBRID, True, 2, 11)
    assert (p.kind, p.rows, p.seqs) == (TOKEN_GRAPH, 16, 2)  # prefill pads rows only
    p = _decide(M.TR_HYBRID, False, 5, 5)
    assert (p.kind, p.rows, p.seqs) == (TOKEN_GRAPH, 8, 8)  # decode pads whole sequences
    assert _decide(M.TR_HYBRID, True, 1, 17).kind == EAGER
    assert _decide(M.NONE, False, 1, 1).kind == EAGER


def test_plan_before_capture_and_with_enforce_eager_is_eager() -> None:
    r = GraphRunner(_config(M.TR_HYBRID), cuda_available=True)
    assert r.plan(False, 2, 2).kind == EAGER  # nothing recorded yet
    r = GraphRunner(_config(M.FULL, enforce_eager=True), cuda_available=True)
    assert r.plan(False, 2, 2).kind == EAGER


def test_plan_pads_the_step_for_the_runner() -> None:
    r = GraphRunner(_config(M.TR_HYBRID), cuda_available=True)
    r._token_sizes = {"decode": [1, 2, 4], "prefill": [1, 2, 4]}  # as after a capture
    assert r.plan(False, 3, 3) == StepPlan(TOKEN_GRAPH, 4, 4, phase="decode")
    assert r.plan(False, 5, 5) == StepPlan(EAGER, 5, 5)
    assert r.plan(True, 2, 3) == StepPlan(TOKEN_GRAPH, 4, 2, phase="prefill")  # rows only
    assert r.plan(True, 1, 9) == StepPlan(EAGER, 9, 1)
    # a verify step of 3 requests x 2 rows: 6 rows of one sequence each -> bucket of 8 rows
    r._token_sizes = {"decode": [2, 4, 8], "prefill": []}
    assert r.plan(False, 6, 6, verify_rows=2) == StepPlan(TOKEN_GRAPH, 8, 8, phase="decode")
    assert r.plan(False, 10, 10, verify_rows=2) == StepPlan(EAGER, 10, 10)


def test_plan_states_its_bucket() -> None:
    with pytest.raises(ValueError, match="req_graph plan only"):
        StepPlan(TOKEN_GRAPH, 4, 4, key=(4, 0), phase="decode")
    with pytest.raises(ValueError, match="req_graph plan only"):
        StepPlan(REQ_GRAPH, 4, 4)
    with pytest.raises(ValueError, match="token_graph plan only"):
        StepPlan(EAGER, 4, 4, phase="decode")
    assert not StepPlan(EAGER, 4, 4).padded and StepPlan(REQ_GRAPH, 4, 4, key=(4, 0)).padded


def test_mode_and_sizes_override() -> None:
    cfg = _config(M.TR_HYBRID)
    r = GraphRunner(cfg, cuda_available=True, mode=M.FULL_DECODE_ONLY, capture_sizes=[2, 6])
    assert r.mode == M.FULL_DECODE_ONLY and r._sizes() == [6, 2]
    assert cfg.compilation_config.cudagraph_mode == M.TR_HYBRID  # the config is untouched
    with pytest.raises(ValueError, match=r"capture_sizes\) exceeds max_num_seqs"):
        GraphRunner(cfg, cuda_available=True, capture_sizes=[64])._sizes()


def test_frozen_gc_restores_state() -> None:
    import gc

    assert gc.isenabled()
    with frozen_gc():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0


# ----------------------------------------------------------------- whole flow, emulated


def _engine(mode: CUDAGraphMode, sizes: list[int]):
    from cpu_recorder import CpuOpRecorder

    from atom.engine.llm_engine import LLMEngine

    cfg = Config(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu",
                 max_num_seqs=8, num_kv_blocks=64, max_model_len=256, seed=3,
                 compilation_config=CompilationConfig(level=0, cudagraph_mode=mode,
                                                      cudagraph_capture_sizes=sizes))
    engine = LLMEngine(cfg)
    if mode != M.NONE:
        assert engine.runner.graph_runner is None  # CPU: resolved to NONE, nothing installed
        engine.runner.graph_runner = GraphRunner(cfg, recorder_factory=CpuOpRecorder)
    engine.warmup()
    return engine


PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3], [9, 8, 7]]
MAX_TOKENS = [6, 2, 5, 3, 4]  # ragged finishes: 5 running (eager), then 4, 3 (padded to 4), 2, 1


def _generate(engine) -> list[list[int]]:
    from atom.engine.params import SamplingParams

    out = []
    for group in ([0, 1, 2, 3, 4], [0, 1], [3], [1, 3]):
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
                  for i in group]
        out += engine.generate([PROMPTS[i] for i in group], params)
    return out


@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    return _generate(_engine(M.NONE, [1, 2, 4]))


@pytest.mark.parametrize("mode", [M.TR_HYBRID, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_TR_HYBRID])
def test_emulated_graphs_match_eager(mode: CUDAGraphMode, eager_tokens: list[list[int]]) -> None:
    from atom.utils.counters import counters
    from atom.utils.forward_context import get_forward_context

    with counters.track() as capture:
        eng = _engine(mode, [1, 2, 4])
    gr = eng.runner.graph_runner
    tr = mode.uses_tr_hybrid()
    assert capture.get("graphs_recorded") == 3  # one per bucket, shared by both phases
    if tr:
        assert gr.token_sizes("decode") == gr.token_sizes("prefill") == [1, 2, 4]
    else:
        assert gr.req_graph.keys() == [(1, 0), (2, 0), (4, 0)]

    steps: list[tuple[bool, int, int, bool]] = []
    plans: list[StepPlan] = []
    inner = gr.maybe_replay

    def logged(runner, input_ids):
        out = inner(runner, input_ids)
        fctx = get_forward_context()
        md = fctx.attn_metadata
        steps.append((fctx.context.is_prefill, md.num_seqs, md.num_rows, out is not None))
        plans.append(fctx.plan)
        return out

    gr.maybe_replay = logged
    with counters.track() as run:
        got = _generate(eng)
    assert got == eager_tokens
    for is_prefill, seqs, rows, replayed in steps:
        expect = rows <= 4 if tr else (not is_prefill and seqs <= 4)
        assert replayed == expect, (is_prefill, seqs, rows)
    assert any(not p and n == 3 and r for p, n, _, r in steps)  # a padded decode replayed
    assert any(not p and n == 5 and not r for p, n, _, r in steps)  # above the largest: eager
    assert any(p and r for p, *_, r in steps) == tr  # a 3-row prefill replays a token graph
    replays = sum(r for *_, r in steps)
    assert run.get("graph_replays") == replays
    assert run.get("eager_steps") == len(steps) - replays
    # The plan was followed: each step ran as its plan's kind, and the counters by kind agree.
    assert [p.padded for p in plans] == [r for *_, r in steps]
    assert {p.kind for p in plans if p.padded} == {TOKEN_GRAPH if tr else REQ_GRAPH}
    by_kind = {k: sum(p.kind == k for p in plans) for k in (EAGER, REQ_GRAPH, TOKEN_GRAPH)}
    assert by_kind == {EAGER: run.get("eager_steps", 0),
                       REQ_GRAPH: run.get("req_graph_replays", 0),
                       TOKEN_GRAPH: run.get("token_graph_replays", 0)}
    layers = eng.hf_config.num_hidden_layers
    # one eager region (attention) per layer per token-graph replay; none inside a full graph
    assert run.get("eager_region_runs", 0) == (layers * replays if tr else 0)


def _small_runner(mode: CUDAGraphMode, q_len: int = 1):
    """A warmed-up CPU engine's runner with an emulated graph runner of buckets 1 and 2."""
    from cpu_recorder import CpuOpRecorder

    from atom.engine.llm_engine import LLMEngine

    cfg = Config(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu",
                 max_num_seqs=8, num_kv_blocks=16, max_model_len=128, seed=5,
                 compilation_config=CompilationConfig(level=0, cudagraph_mode=mode,
                                                      cudagraph_capture_sizes=[1, 2]))
    eng = LLMEngine(cfg)
    gr = eng.runner.graph_runner = GraphRunner(cfg, recorder_factory=CpuOpRecorder, q_len=q_len)
    eng.warmup()
    return eng.runner, gr


@pytest.mark.parametrize("mode", [M.FULL, M.TR_HYBRID])
def test_multi_row_decode_buckets(mode: CUDAGraphMode) -> None:
    """Decode steps verifying a draft token (2 query rows per request) have their own buckets:
    request buckets (bs, 1) under FULL, token buckets of bs * 2 rows under TR_HYBRID."""
    import torch

    runner, gr = _small_runner(mode, q_len=2)
    if mode == M.FULL:  # beside the plain buckets, for decode steps without a draft
        assert gr.req_graph.keys() == [(1, 0), (1, 1), (2, 0), (2, 1)]
    else:
        assert gr.token_sizes("decode") == [2, 4]
    assert gr.plan(False, 2, 4, q_len=2).rows == 4
    with torch.inference_mode():
        # A verify step's layout (atom.spec_decode.decoder): 2 one-token rows per request.
        ids, pos, md, ctx = runner.build_dummy_decode(2, 2, verify=True)
        assert (md.max_seqlen_q, md.request_q_len, ctx.running_bs) == (1, 2, 2)
        ids.copy_(torch.tensor([7, 8, 9, 10]))
        plan = gr.plan(False, 4, 4, verify_rows=2)  # 2 requests of 2 one-token rows
        assert (plan.kind, plan.rows, plan.seqs) == (
            (REQ_GRAPH, 4, 4) if mode == M.FULL else (TOKEN_GRAPH, 4, 4))
        with runner.step_context(md, ctx, plan=plan):
            out = gr.maybe_replay(runner, ids)
            assert out is not None
            out = out.clone()
            ref = runner.model(ids, pos)
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("mode", [M.FULL, M.TR_HYBRID])
def test_replay_refuses_inputs_the_plan_does_not_describe(mode: CUDAGraphMode) -> None:
    """A plan and inputs that disagree are an error, never a silent eager step; so is a plan
    naming a bucket this capture did not record."""
    import torch

    runner, gr = _small_runner(mode)
    plan = gr.plan(False, 2, 2)
    assert plan.kind == (REQ_GRAPH if mode == M.FULL else TOKEN_GRAPH) and plan.rows == 2
    unrecorded = (StepPlan(REQ_GRAPH, 4, 4, key=(4, 0)) if mode == M.FULL
                  else StepPlan(TOKEN_GRAPH, 4, 4, phase="decode"))
    with torch.inference_mode():
        ids, _, md, ctx = runner.build_dummy_decode(1)  # one row, planned as two
        with runner.step_context(md, ctx, plan=plan), pytest.raises(ValueError, match="planned"):
            gr.maybe_replay(runner, ids)
        ids, _, md, ctx = runner.build_dummy_decode(4)
        with runner.step_context(md, ctx, plan=unrecorded), pytest.raises(
                ValueError, match="no graph"):
            gr.maybe_replay(runner, ids)
        with runner.step_context(md, ctx):  # no plan: eager, whatever the rows
            assert gr.maybe_replay(runner, ids) is None
