"""Every graph mode at levels 0 and 3 on the real engine: greedy tokens identical to eager
over several prompts and batch compositions, and counters proving what was recorded, what
replayed and what ran eagerly (no silent eager fallback)."""

from __future__ import annotations

import pytest
import torch

from atom.config import CompilationConfig, Config, CUDAGraphMode
from atom.utils.counters import counters

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

M = CUDAGraphMode
SIZES = [1, 2, 4, 8]
MODES = [M.TR_HYBRID, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_TR_HYBRID]
# Ragged prompt lengths and output lengths: the running batch shrinks through the buckets
# (11 > 8 eager, then 8, 7 -> 8, 5 -> 8, 3 -> 4, ...), so buckets interleave across steps.
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(1 + (5 * i) % 13)] for i in range(11)]
MAX_TOKENS = [3 + (i * 4) % 11 for i in range(11)]


def _engine(level: int):
    from atom.engine.llm_engine import LLMEngine

    cfg = Config(model="tiny-llama", load_format="dummy", dtype="float32", device="cuda",
                 max_num_seqs=16, max_model_len=256, num_kv_blocks=256, seed=7,
                 gpu_memory_utilization=0.3,
                 compilation_config=CompilationConfig(level=level, cudagraph_mode=M.TR_HYBRID,
                                                      cudagraph_capture_sizes=SIZES))
    engine = LLMEngine(cfg)
    engine.warmup()  # compiles (level 3) and captures the configured mode once
    assert engine.runner.graph_runner is not None
    engine.runner.graph_runner = None  # the eager reference; each test installs its own
    return engine


def _run(engine) -> list[list[int]]:
    from atom.engine.params import SamplingParams

    out = []
    # all at once (above the largest bucket at first), then 3, then 1, then a short prefill
    for group in (list(range(11)), [0, 4, 9], [5], [0, 1]):
        params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
                  for i in group]
        out += engine.generate([PROMPTS[i] for i in group], params)
    return out


class StepLog:
    """Wraps maybe_replay: per step (is_prefill, real seqs, real rows, replayed)."""

    def __init__(self, gr) -> None:
        from atom.utils.forward_context import get_forward_context

        self.steps: list[tuple[bool, int, int, bool]] = []
        inner = gr.maybe_replay

        def wrapped(runner, input_ids):
            fctx = get_forward_context()
            out = inner(runner, input_ids)
            md = fctx.attn_metadata
            self.steps.append((fctx.context.is_prefill, md.num_seqs, md.num_rows, out is not None))
            return out

        gr.maybe_replay = wrapped


@pytest.fixture(scope="module", params=[0, 3], ids=["level0", "level3"])
def level_engine(request):
    engine = _engine(request.param)
    baseline = _run(engine)  # eager reference at this level (same weights, same kernels)
    yield engine, baseline
    del engine
    torch.cuda.empty_cache()


@pytest.mark.parametrize("mode", MODES, ids=[m.name for m in MODES])
def test_mode_matches_eager(level_engine, mode: CUDAGraphMode) -> None:
    from atom.cudagraph.runner import GraphRunner

    engine, baseline = level_engine
    runner = engine.runner
    gr = GraphRunner(engine.config, mode=mode)
    assert gr.active
    runner.graph_runner = gr
    try:
        with counters.track() as cap:
            seconds, sizes = runner.capture_cudagraph()
        assert sizes == SIZES and seconds > 0
        tr = mode.uses_tr_hybrid()
        # Decode recordings hold attention inline (its launches are fixed by the bucket), so
        # the prefill pass records its own, breaking at attention: two per bucket under TR.
        assert cap.get("graphs_recorded") == len(SIZES) * (2 if tr else 1)
        if tr:
            assert gr.token_sizes("decode") == gr.token_sizes("prefill") == SIZES
        else:
            assert gr.req_graph.keys() == [(s, 0) for s in SIZES]

        log = StepLog(gr)
        with counters.track() as run:
            got = _run(engine)
        assert got == baseline

        # Which steps replayed is exactly what the mode promises.
        for is_prefill, seqs, rows, replayed in log.steps:
            if tr:
                expect = rows <= SIZES[-1]  # prefill and decode alike, by token count
            else:
                expect = not is_prefill and seqs <= SIZES[-1]  # mixed batches eager
            assert replayed == expect, (mode, is_prefill, seqs, rows)
        n_replayed = sum(s[3] for s in log.steps)
        assert n_replayed > 0 and any(not s[3] for s in log.steps)
        assert any(not s[0] and s[1] > SIZES[-1] and not s[3] for s in log.steps)  # above bucket
        if tr:  # a prefill that fits a bucket replays a token graph too
            assert any(s[0] and s[3] for s in log.steps)
        if mode == M.FULL_DECODE_ONLY:
            assert all(not s[3] for s in log.steps if s[0])
        assert run.get("graph_replays") == n_replayed
        assert run.get("eager_steps") == len(log.steps) - n_replayed
        layers = engine.hf_config.num_hidden_layers
        # one eager region (attention) per layer per prefill token-graph replay; decode
        # token graphs and FULL graphs replay attention inside the graph
        n_prefill_replays = sum(1 for s in log.steps if s[0] and s[3])
        assert run.get("eager_region_runs", 0) == (layers * n_prefill_replays if tr else 0)
    finally:
        runner.graph_runner = None
        del gr
        torch.cuda.synchronize()
