"""The eager-path warm-up (atom.engine.eager_warmup): what it runs, and that it leaves the
engine as it found it (no request, no cached block, no prefix-cache counts)."""

from __future__ import annotations

from atom.config import Config
from atom.engine import LLMEngine, SamplingParams
from atom.engine.eager_warmup import sampled_row_counts, warm_eager_paths, waves
from atom.kernels import tuning
from atom.utils.counters import counters


def test_waves_cover_every_logits_row_count_and_block_m() -> None:
    counts = sampled_row_counts(256)
    assert counts == [*range(1, tuning.GEMV_MAX_ROWS + 2), 2 * tuning.GEMV_MAX_ROWS]
    assert sampled_row_counts(4) == [1, 2, 3, 4]
    ws = list(waves(256, 4000))
    prefill_rows = [len(w.prompt_lens) for w in ws if w.join_after_steps is None]
    assert set(counts) <= set(prefill_rows)
    longest = {max(w.prompt_lens) for w in ws}
    assert {8, 24, 100} <= longest  # BLOCK_M 16, 32, 64 of the prefill kernel
    assert any(w.join_after_steps for w in ws)  # a mixed step
    assert any(not w.params.greedy for w in ws) and any(w.params.logprobs for w in ws)
    assert max(max(w.prompt_lens) for w in waves(256, 20)) == 20  # clamped to the model
    # Repeats over long cached contexts (the split-KV prefill), only where the model allows.
    assert {512, 514, 518, 2048, 2054} <= longest
    assert max(max(w.prompt_lens) for w in waves(256, 1000)) == 518


def test_warm_up_runs_real_steps_and_leaves_no_trace() -> None:
    e = LLMEngine(Config(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu",
                         max_model_len=128, num_kv_blocks=256, max_num_seqs=8, seed=3))
    assert warm_eager_paths(e) == 0.0  # the CPU compiles no Triton kernels: nothing to do
    before = counters.snapshot().get("eager_steps", 0)
    assert warm_eager_paths(e, force=True) > 0.0
    assert counters.snapshot().get("eager_steps", 0) > before
    bm = e.block_manager
    assert not e.has_unfinished_requests()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == bm.num_blocks
    assert bm.stats.queries == 0 and bm.stats.hits == 0
    # The engine serves as before: the same greedy tokens as a fresh one.
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    fresh = LLMEngine(Config(model="tiny-llama", load_format="dummy", dtype="float32",
                             device="cpu", max_model_len=128, num_kv_blocks=256, max_num_seqs=8,
                             seed=3))
    prompt = [10 + (i * 7) % 240 for i in range(40)]
    assert e.generate([prompt], params) == fresh.generate([prompt], params)
    assert bm.stats.hits == 0  # the warm-up's prompt with the same ids was forgotten
