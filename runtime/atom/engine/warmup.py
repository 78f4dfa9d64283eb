"""Warm-up orchestration: compile (levels 2-3), capture the CUDA graphs, warm the eager paths.

`warm_up(engine)` runs once before the first request (LLMEngine.warmup delegates here) and
returns the summary that logs and /status show. It drives the engine only through
`WarmupTarget` (atom.engine.api), so the engine imports this module and nothing here imports
the engine back.
"""

from __future__ import annotations

import time
from typing import Any

from atom.engine.api import WarmupTarget
from atom.engine.eager_warmup import warm_eager_paths
from atom.utils.counters import counters


def warm_up(engine: WarmupTarget) -> dict[str, Any]:
    """Compile and capture the target's runner (and draft runner), then run the eager waves."""
    before = counters.snapshot()
    t0 = time.perf_counter()
    compile_s = engine.runner.warmup_model()
    capture_s, sizes = engine.runner.capture_cudagraph()
    draft_sizes: list[int] = []
    draft = engine.draft_runner
    if draft is not None:
        compile_s += draft.warmup_model()
        draft_s, draft_sizes = draft.capture_cudagraph()
        capture_s += draft_s
    eager_s = warm_eager_paths(engine)
    config = engine.config
    cc = config.compilation_config
    return {
        "model": config.model,
        "level": int(cc.level),
        "cudagraph_mode": str(cc.cudagraph_mode) if cc.cudagraph_mode is not None else "NONE",
        "warmup_seconds": round(time.perf_counter() - t0, 3),
        "compile_seconds": round(compile_s, 3),
        "capture_seconds": round(float(capture_s), 3),
        "eager_warmup_seconds": round(eager_s, 3),
        "captured_sizes": list(sizes),
        "draft_captured_sizes": list(draft_sizes),
        "kv_blocks_total": engine.block_manager.num_blocks,
        "max_model_len": config.max_model_len,
        "counters": counters.delta(before),
    }
