"""Warm the eager steps' Triton kernels before the first request (CUDA only).

Capture fixes the decode steps' kernels, but prefill and mixed steps run eagerly (or between
token-graph segments), and their Triton kernels are compiled per specialization on first use:
the logits GEMV per row count up to tuning.GEMV_MAX_ROWS (its tile plan and BLOCK_M follow the
rows), the row kernels' row count modulo 16, the prefill attention's BLOCK_M (16, 32 or 64 from
the longest query of the step), the sampled path's fp32 argmax and copies, Triton's C launcher
per signature. On the H200 a served request that met one of them first waited 0.4-1.2 s (the
first prefill, the first mixed step, the first 16-row mixed step: issue 26's step records), and
offline runs never saw it because their warm-up batches had already compiled them.

So the engine runs a few tiny synthetic requests through its own scheduler and runner at start:
every sampled-row count of a prefill step up to GEMV_MAX_ROWS + 1 and 2 * GEMV_MAX_ROWS, queries
of each BLOCK_M, a mixed step, cached prefixes (short chunks over 512-2,048 cached tokens: the
split-KV prefill), sampled and greedy rows, with and without logprobs. Compiled kernels land in Triton's cache (the compile-cache volume), so a warm start
only loads them. The prefix cache and its counters are reset afterwards: the synthetic prompts
must not look like hits to real traffic.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from atom.engine.api import WarmupTarget
from atom.engine.params import SamplingParams
from atom.kernels import tuning

logger = logging.getLogger(__name__)
MAX_STEPS = 2000
SPLIT_CONTEXTS = (512, 1024, 2048)
GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=True)
SAMPLED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=2, ignore_eos=True)


@dataclass(frozen=True)
class Wave:
    """Requests added together (one prefill step), optionally while others decode."""

    prompt_lens: tuple[int, ...]
    params: SamplingParams = field(default_factory=lambda: GREEDY)
    join_after_steps: int | None = None  # added after the previous wave ran this many steps


def sampled_row_counts(max_num_seqs: int) -> list[int]:
    """Each row count the logits projection specializes on, up to the scheduler's cap."""
    counts = {*range(1, tuning.GEMV_MAX_ROWS + 2), 2 * tuning.GEMV_MAX_ROWS}
    return sorted(m for m in counts if m <= max_num_seqs)


def waves(max_num_seqs: int, max_len: int) -> Iterator[Wave]:
    def cap(n: int) -> int:
        return max(1, min(n, max_len))

    # The prefill step samples m rows: compute_logits at m.
    for m in sampled_row_counts(max_num_seqs):
        yield Wave((cap(8),) * m)
    for q in (24, 100):  # BLOCK_M 32 and 64
        yield Wave((cap(q),))
    yield Wave((cap(8),), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    yield Wave((cap(40), cap(8)), GREEDY, join_after_steps=1)  # mixed: decodes + prefills
    yield Wave((cap(40),))  # the same prompt again: a prefill over a cached prefix
    # Short chunks over long cached contexts: the split-KV prefill's splits (8, 16, 32 for one
    # sequence) and row blocks (16, 2 and 6 rows: BLOCK_Q 16, 4, 8).
    for length in SPLIT_CONTEXTS:
        if length + 8 <= max_len:
            yield Wave((length,))
            for extra in (0, 2, 6):
                yield Wave((length + extra,))
    yield Wave((cap(8),) * min(2, max_num_seqs), SAMPLED)


def _prompt(n: int, salt: int) -> list[int]:
    # Ids any vocabulary of >= 256 has; the same lengths always give the same prompts.
    return [10 + (salt * 31 + i * 7) % 240 for i in range(n)]


def warm_eager_paths(engine: WarmupTarget, *, force: bool = False) -> float:
    """Run the synthetic waves to completion; seconds spent (0 where nothing needs it: the
    CPU compiles no Triton kernels). force: on any device (tests of the mechanics)."""
    if engine.has_unfinished_requests() or not (force or engine.runner.device.type == "cuda"):
        return 0.0
    t0 = time.perf_counter()
    bm = engine.block_manager
    # A prompt fits the model and a quarter of the cache (a small test cache must not stall).
    max_len = max(1, min(engine.config.model_limits().max_model_len - 8,
                         bm.num_blocks * bm.block_size // 4))
    pending: list[Wave] = list(waves(engine.config.max_num_seqs, max_len))
    ids: list[str] = []
    steps = 0
    while pending:
        wave = pending.pop(0)
        for i, length in enumerate(wave.prompt_lens):
            ids.append(f"eager-warmup-{len(ids)}")
            engine.add_request(ids[-1], _prompt(length, i), wave.params)
        joins = pending[0].join_after_steps if pending else None
        while engine.has_unfinished_requests() and (joins is None or joins > 0):
            engine.step()
            steps += 1
            joins = None if joins is None else joins - 1
            if steps > MAX_STEPS:  # never hold the start-up: the kernels compile on first use
                logger.warning("eager warm-up stopped after %d steps", steps)
                for rid in ids:
                    engine.abort_request(rid)
                pending.clear()
                break
    while engine.has_unfinished_requests():  # the last wave's tail, or the aborts' outputs
        engine.step()
    bm.reset_prefix_cache()
    return time.perf_counter() - t0
