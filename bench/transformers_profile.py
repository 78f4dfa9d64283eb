"""How much of transformers' decode step is GPU work (issue 5's baseline).

decode_bench.py times transformers' generate() (static cache, torch.compile) per step as
(time of n1 new tokens - time of n0) / (n1 - n0). This script measures the same difference
twice per batch: in wall time, and in GPU busy time (the union of every CUDA activity's
interval in a torch.profiler trace of each generate call). Their gap is time the GPU waits for
the host: generate's Python between replays of the compiled forward. That part moves with the
host's CPU, so it says how far the baseline can move between machines with the same GPU.

    python bench/transformers_profile.py --out results.json [--batches 1 8 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import decode_bench as db
from step_timeline import Kernel, gpu_activities


def busy_us(kernels: Sequence[Kernel]) -> float:
    """Microseconds in which at least one of the activities runs."""
    total, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.start_us):
        if k.end_us > end:
            total += k.end_us - max(k.start_us, end)
            end = k.end_us
    return total


def profiled(model: Any, ids: torch.Tensor, new_tokens: int, cache_tokens: int
             ) -> tuple[float, list[Kernel]]:
    """(wall seconds under the profiler, CUDA activities) of one generate() call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = db.transformers_generate(model, ids, new_tokens, cache_tokens)
    return wall, gpu_activities(prof.events())[1]


def measure(model: Any, batch: int, context: int, n0: int, n1: int, repeats: int
            ) -> dict[str, Any]:
    ids, _ = db.transformers_warm_prompt(model, batch, context, n1)
    steps = n1 - n0
    wall, busy, wall_profiled, kernels = [], [], [], []
    for _ in range(repeats):
        wall.append(db.transformers_pair_ms(model, ids, n0, n1))
        p0, k0 = profiled(model, ids, n0, n1)
        p1, k1 = profiled(model, ids, n1, n1)
        wall_profiled.append((p1 - p0) / steps * 1e3)
        busy.append((busy_us(k1) - busy_us(k0)) / steps / 1e3)
        kernels.append((len(k1) - len(k0)) / steps)
    out = {"wall_ms": statistics.median(wall), "gpu_busy_ms": statistics.median(busy),
           "wall_under_profiler_ms": statistics.median(wall_profiled),
           "activities_per_step": statistics.median(kernels),
           "samples": {"wall_ms": wall, "gpu_busy_ms": busy,
                       "wall_under_profiler_ms": wall_profiled}}
    out["gpu_busy_share"] = out["gpu_busy_ms"] / out["wall_ms"]
    print(f"batch {batch:>3}: wall {out['wall_ms']:.3f} ms/step, GPU busy "
          f"{out['gpu_busy_ms']:.3f} ms/step ({out['gpu_busy_share']:.0%}), "
          f"{out['activities_per_step']:.0f} GPU activities/step; under the profiler "
          f"{out['wall_under_profiler_ms']:.3f} ms/step", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    ap.add_argument("--n0", type=int, default=16, help="new tokens of the short generate()")
    ap.add_argument("--n1", type=int, default=80, help="new tokens of the long generate()")
    ap.add_argument("--repeats", type=int, default=5, help="pairs per batch (median)")
    ap.add_argument("--commit", default="", help="commit the tree is at, for the record")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("transformers_profile.py needs a CUDA device")
    import transformers

    model = db.transformers_model()
    result: dict[str, Any] = {
        "commit": args.commit, "device": torch.cuda.get_device_name(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "context": args.context, "n0": args.n0, "n1": args.n1, "repeats": args.repeats,
        "batches": {str(b): measure(model, b, args.context, args.n0, args.n1, args.repeats)
                    for b in args.batches},
    }
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
