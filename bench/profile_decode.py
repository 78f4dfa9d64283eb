"""Where a decode step's time goes on the GPU (issue 5): kernel times per graph replay.

For each batch: builds the level-3 engine once (bench/decode_bench.py helpers), records FULL
graphs, then profiles --iters replays of run_model with torch.profiler and reports per kernel
name: calls per step, microseconds per step, share of the step; the sum of kernel time per step
against the wall time (the difference is GPU idle: launch gaps, host work); and, since early
launches overlap, what each kernel adds to the end of the step (bench/step_timeline.py).
Each projection's cuBLAS GEMM on its own: bench/gemv_sweep.py.

    python bench/profile_decode.py --out profile.json [--batches 1 8 64] [--compare ALT ...]
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import decode_bench as db
import step_timeline as st
from common import sync


def kernel_table(engine: Any, iters: int) -> dict[str, Any]:
    """Profile iters run_model calls of the prepared decode batch; per-kernel us per step."""
    from torch.profiler import ProfilerActivity, profile

    with db.prepared_decode(engine) as (runner, input_ids, idx):
        for _ in range(5):
            runner.run_model(input_ids, idx)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            runner.run_model(input_ids, idx)
        sync()
        wall_us = (time.perf_counter() - t0) / iters * 1e6
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                runner.run_model(input_ids, idx)
            sync()
    per, timeline = st.gpu_activities(prof.events())
    total = sum(v[1] for v in per.values()) / iters
    rows = sorted(((k, v[0] / iters, v[1] / iters) for k, v in per.items()),
                  key=lambda r: -r[2])
    try:
        span, charged = st.charged_by_label(timeline, len(timeline) // iters,
                                            engine.runner.model.config.num_hidden_layers)
    except ValueError as e:  # replays of unequal launch counts: no per-step timeline
        print(f"  no step timeline: {e}")
        span, charged = 0.0, []
    return {"wall_us": round(wall_us, 1), "kernel_us": round(total, 1),
            "kernels_per_step": round(sum(r[1] for r in rows), 1),
            "kernels": [{"name": k, "calls": round(c, 2), "us": round(u, 2),
                         "share": round(u / total, 4) if total else 0} for k, c, u in rows],
            # What each kernel adds to the step's end (bench/step_timeline.py), medians.
            "span_us": round(span, 1),
            "charged": [{"label": k, "us": round(u, 2)} for k, u in charged]}


# Alternatives to the engine's defaults, recorded beside them in one run (--compare):
# name -> (module, attribute, value while recording and replaying).
ALTERNATIVES = {
    # The KV-store kernel before decode attention, instead of the decode kernel storing them.
    "store-first": ("atom.kernels.tuning", "FUSED_DECODE_STORE", False),
    # o_proj as its own GEMV launch after decode attention, instead of sharing its launch.
    "o-proj-apart": ("atom.kernels.tuning", "FUSED_DECODE_O_PROJ", False),
    # The fused launch at 4 warps with 8 weight rows a program (three programs per SM) ...
    "o-proj-strip8-4warps": [("atom.kernels.tuning", "FUSED_O_PROJ_STRIP_BYTES", 32 * 1024),
                             ("atom.kernels.tuning", "FUSED_O_PROJ_WARPS", 4)],
    # ... or at 8 warps (two per SM).
    "o-proj-strip8": ("atom.kernels.tuning", "FUSED_O_PROJ_STRIP_BYTES", 32 * 1024),
    # The fused launch with the weights loaded after the wait: what the preload buys.
    "o-proj-no-preload": ("atom.kernels.tuning", "FUSED_O_PROJ_PRELOAD", False),
    # The decode attention as an ordinary launch, not started early beside the qkv projection.
    "no-pdl": ("atom.kernels.tuning", "DECODE_PDL", False),
    # One-row projections (qkv) on the tiled GEMV, not the early-launched preloading kernel.
    "no-row-gemv": ("atom.kernels.tuning", "ROW_GEMV_MAX_ROWS", 0),
    # The preloading kernel for decode batches up to 8 rows (qkv, and o_proj after attention).
    "row-gemv-8": ("atom.kernels.tuning", "ROW_GEMV_MAX_ROWS", 8),
    # At one row, only the single-wave tiled projections launched early (gate_up in strips of
    # 64, spread one per SM), not every one.
    "one-wave-at-one-row": ("atom.kernels.tuning", "TILED_PDL_MAX_ROWS", 0),
    # Above one row, no tiled projection launched early (before session 8) ...
    "one-wave-off": ("atom.kernels.tuning", "ONE_WAVE_PDL_MAX_ROWS", 0),
    # ... or the single-wave ones at up to 8 rows, not 16.
    "one-wave-8": ("atom.kernels.tuning", "ONE_WAVE_PDL_MAX_ROWS", 8),
    # Decode attention split for 64 or 128 programs in all rather than 512: at one row, 8 or
    # 16 splits per kv head instead of up to 64 (fewer idle split programs in the launch) ...
    "decode-programs-64": ("atom.kernels.tuning", "DECODE_TARGET_PROGRAMS", 64),
    "decode-programs-128": ("atom.kernels.tuning", "DECODE_TARGET_PROGRAMS", 128),
    # ... or at most 1 or 4 splits per row (no combine, or a combine of 4 partials).
    "decode-splits-1": ("atom.kernels.tuning", "DECODE_MAX_SPLITS", 1),
    "decode-splits-4": ("atom.kernels.tuning", "DECODE_MAX_SPLITS", 4),
    # Key tiles of 32 rather than 64 (at one row and 512 tokens: 16 splits a kv head hold keys,
    # not 8).
    "decode-tile-32": ("atom.kernels.tuning", "DECODE_TILE_N", 32),
    # Early tiled launches with no weight tile loaded before their wait (down_proj loads one) ...
    "tiled-no-preload": ("atom.kernels.tuning", "TILED_PRELOAD_MIN_K", 1 << 30),
    # ... or every plain early launch loading one (qkv and o_proj at 2-16 rows too).
    "tiled-preload-plain": ("atom.kernels.tuning", "TILED_PRELOAD_MIN_K", 0),
    # One-wave early launches in strips of BLOCK_N rows (qkv at 8 rows: 96 programs, not 128).
    "full-strips": ("atom.kernels.tuning", "EVEN_STRIPS", False),
    # Neither the attention nor qkv launched early (the tiled projections still are).
    "no-early-launch": [("atom.kernels.tuning", "DECODE_PDL", False),
                        ("atom.kernels.tuning", "ROW_GEMV_MAX_ROWS", 0)],
}


@contextmanager
def alternative(name: str | None) -> Iterator[None]:
    settings = ALTERNATIVES[name] if name else []
    settings = [settings] if isinstance(settings, tuple) else settings
    saved = []
    for module, attr, value in settings:
        mod = importlib.import_module(module)
        saved.append((mod, attr, getattr(mod, attr)))
        setattr(mod, attr, value)
    try:
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def main() -> None:
    ap = db.profile_parser(__doc__, level=3)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--compare", nargs="*", default=[], choices=sorted(ALTERNATIVES),
                    help="also record each mode with these alternatives (see ALTERNATIVES)")
    args = ap.parse_args()
    from atom.config import CUDAGraphMode

    engine, result = db.profile_setup(args.level, args.batches, args.context, "profiles",
                                      args.max_model_len)
    # name -> (mode, alternative or None): a graph keeps the settings it was recorded with.
    variants = {m: (m, None) for m in args.modes}
    variants.update({f"{m}-{alt}": (m, alt) for m in args.modes for alt in args.compare})
    runners = {}
    for name, (m, alt) in variants.items():
        with alternative(alt):
            runners[name] = (db.capture(engine, CUDAGraphMode.parse(m), sorted(args.batches))[0]
                             if m != "NONE" else None)
    for b in args.batches:
        with db.filled_batch(engine, b, args.context):
            for m in variants:
                engine.runner.graph_runner = runners[m]
                with alternative(variants[m][1]):  # eager (NONE) reads the settings per call
                    t = kernel_table(engine, args.iters)
                result["profiles"][f"{m}/{b}"] = t
                print(f"\n== level {args.level} {m} batch {b}: wall {t['wall_us']} us/step, "
                      f"kernels {t['kernel_us']} us/step ({t['kernels_per_step']} launches)")
                for r in t["kernels"][:25]:
                    print(f"  {r['us']:8.2f} us {100 * r['share']:5.1f}%  x{r['calls']:<5} "
                          f"{r['name']}")
                print(f"  charged to each kernel (GPU span {t['span_us']} us/step):")
                for r in t["charged"]:
                    print(f"  {r['us']:8.2f} us  {r['label']}")
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
