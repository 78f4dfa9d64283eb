"""Prefill token buckets above the decode capture sizes (atom.cudagraph.buckets): the ladder,
the dummy batch's layout, and TR_HYBRID recording and replaying them (CPU emulation of the
capture, tests/runtime/cpu_recorder.py) with the eager tokens."""

from __future__ import annotations

import pytest

from atom.config import CompilationConfig, Config, CUDAGraphMode
from atom.cudagraph.buckets import (
    DEFAULT_PREFILL_TOKEN_SIZES,
    DummyLayout,
    dummy_layout,
    prefill_token_sizes,
)
from atom.cudagraph.runner import TOKEN_GRAPH, GraphRunner, pad_to_bucket

LADDER = list(range(1, 9)) + list(range(16, 513, 16))


def test_default_ladder_reaches_the_token_budget() -> None:
    sizes = prefill_token_sizes(LADDER, None, 8192, 512, 16)
    assert sizes[: len(LADDER)] == LADDER
    assert sizes[len(LADDER):] == [768, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    # the budget caps it; a step between two buckets pads to the next (at most 1.5x)
    assert prefill_token_sizes(LADDER, None, 2048, 512, 16)[-4:] == [768, 1024, 1536, 2048]
    assert pad_to_bucket(1100, sizes) == 1536 and pad_to_bucket(8193, sizes) is None
    ratios = [b / a for a, b in zip(sizes[len(LADDER) - 1:], sizes[len(LADDER):], strict=False)]
    assert max(ratios) <= 1.5
    assert prefill_token_sizes(LADDER, [], 8192, 512, 16) == LADDER  # [] turns them off
    # only sizes above the decode ladder are added
    assert prefill_token_sizes([1, 2, 1024], [512, 2048], 4096, 512, 16) == [1, 2, 1024, 2048]
    assert set(DEFAULT_PREFILL_TOKEN_SIZES) <= set(range(16, 8193, 16))


def test_dummy_layout_fits_the_runner_buffers() -> None:
    assert dummy_layout(300, 512, 16) == DummyLayout(300, 1)  # as the decode ladder records
    assert dummy_layout(768, 512, 16) == DummyLayout(384, 2)
    assert dummy_layout(3072, 512, 16) == DummyLayout(512, 6)
    assert dummy_layout(8192, 512, 16) == DummyLayout(512, 16)
    assert dummy_layout(8192, 256, 16) is None  # 32 rows a sequence: more than a block
    # a bucket no layout fits is not recorded
    assert 8192 not in prefill_token_sizes(LADDER[:20], None, 8192, 256, 16)


def test_config_takes_prefill_token_sizes_outside_the_cache_key() -> None:
    a = CompilationConfig(level=3, prefill_token_sizes=[1024, 2048])
    assert a.prefill_token_sizes == [1024, 2048]
    assert a.hash_factors() == CompilationConfig(level=3).hash_factors()
    with pytest.raises(ValueError, match="prefill_token_sizes"):
        CompilationConfig(prefill_token_sizes=[0])


def _engine(mode: CUDAGraphMode | None, prefill: list[int] | None):
    from cpu_recorder import CpuOpRecorder

    from atom.engine.llm_engine import LLMEngine

    cfg = Config(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu",
                 max_num_seqs=8, num_kv_blocks=64, max_model_len=256, seed=3,
                 max_num_batched_tokens=64,
                 compilation_config=CompilationConfig(
                     level=0, cudagraph_mode=mode or CUDAGraphMode.NONE,
                     cudagraph_capture_sizes=[1, 2, 4], prefill_token_sizes=prefill))
    engine = LLMEngine(cfg)
    if mode is not None:
        engine.runner.graph_runner = GraphRunner(cfg, recorder_factory=CpuOpRecorder)
    engine.warmup()
    return engine


PROMPTS = [list(range(10, 40)), list(range(50, 110)), [7, 8, 9]]


def _generate(engine) -> list[list[int]]:
    from atom.engine.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    return [engine.generate([p], params)[0] for p in PROMPTS] + engine.generate(PROMPTS, params)


def test_prefill_buckets_record_and_replay_the_eager_tokens() -> None:
    eager = _generate(_engine(None, None))
    engine = _engine(CUDAGraphMode.TR_HYBRID, [16, 32, 64])
    gr = engine.runner.graph_runner
    assert gr.token_sizes("decode") == [1, 2, 4]
    assert gr.token_sizes("prefill") == [1, 2, 4, 16, 32, 64]
    plans = []
    inner = gr.maybe_replay

    def logged(runner, input_ids):
        from atom.utils.forward_context import get_forward_context

        out = inner(runner, input_ids)
        fctx = get_forward_context()
        if fctx.context.is_prefill:
            plans.append((fctx.attn_metadata.num_rows, fctx.plan, out is not None))
        return out

    gr.maybe_replay = logged
    assert _generate(engine) == eager
    # 30 and 60-token prefills replay the 32- and 64-row buckets
    replayed = {(rows, plan.rows) for rows, plan, ok in plans if ok and plan.kind == TOKEN_GRAPH}
    assert {(30, 32), (60, 64)} <= replayed
