"""Where a whole engine step's time goes on the host (issue 5): LLMEngine.step() in phases.

bench/decode_bench.py reports the step beside the forward: the difference is host work that
the GPU waits for. Here each phase of --steps decode steps is timed on the host: scheduling,
input preparation (host lists to the device buffers), the forward's launch (a graph replay
and the logits' projection), sampling's launch, reading a step's tokens (which waits for the
GPU to finish that step: with asynchronous steps the one launched before, with --sync this
one), and the rest of the step.

    python bench/profile_step.py --out step.json [--batches 1 8 64] [--modes FULL] [--level 0]
        [--sync]          # Config.async_scheduling off: each step ends with its tokens read
        [--cprofile 30]   # also the host functions taking the most time (cProfile, own time)
        [--kernels 12]    # also the GPU work of a step outside the forward's kernels
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_bench as db  # noqa: E402

PHASES = ("schedule", "prepare", "launch", "sample", "read")


def _timed(record: list[float], fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, appending each call's host seconds to record."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        record.append(time.perf_counter() - t0)
        return out

    return wrapper


def phase_table(engine: Any, steps: int) -> dict[str, float]:
    """Median microseconds per phase over `steps` decode steps (and the whole step)."""
    rec: dict[str, list[float]] = defaultdict(list)
    timed = {(engine.scheduler, "schedule"): "schedule",
             (engine.runner, "prepare_inputs"): "prepare", (engine.runner, "run_model"): "launch",
             (engine.sampler, "sample"): "sample", (engine, "_read"): "read"}
    for (obj, attr), phase in timed.items():  # instance attributes, deleted afterwards
        setattr(obj, attr, _timed(rec[phase], getattr(obj, attr)))
    try:
        for _ in range(3):
            engine.step()
        for r in rec.values():
            r.clear()
        totals = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            totals.append(time.perf_counter() - t0)
    finally:
        for obj, attr in timed:
            delattr(obj, attr)
    out = {p: round(statistics.median(rec[p]) * 1e6, 1) for p in PHASES}
    out["step"] = round(statistics.median(totals) * 1e6, 1)
    out["rest"] = round(out["step"] - sum(out[p] for p in PHASES), 1)
    return out


def step_kernels(engine: Any, steps: int, top: int) -> list[dict[str, Any]]:
    """The `top` GPU activities (kernels, copies) of `steps` engine steps by time, us and
    calls per step (torch.profiler): with profile_decode's forward, what a step adds."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.step()
    db._sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        db._sync()
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = per[ev.name[:80]]
            rec[0] += 1
            rec[1] += ev.device_time_total
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": k, "calls": round(c / steps, 2), "us": round(u / steps, 2)}
            for k, (c, u) in rows]


def main() -> None:
    ap = db.profile_parser(__doc__, level=0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync", action="store_true", help="synchronous steps (async_scheduling off)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also list the N GPU activities taking the most time per step")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the N host functions with the most own time over the steps")
    args = ap.parse_args()
    from atom.config import CUDAGraphMode

    engine, result = db.profile_setup(args.level, args.batches, args.context, "phases_us")
    engine.async_scheduling = not args.sync
    result["async_scheduling"] = engine.async_scheduling
    runners = {m: db.capture(engine, CUDAGraphMode.parse(m), sorted(args.batches))[0]
               for m in args.modes}
    for b in args.batches:
        with db.filled_batch(engine, b, args.context):
            for m in args.modes:
                engine.runner.graph_runner = runners[m]
                t = phase_table(engine, args.steps)
                result["phases_us"][f"{m}/{b}"] = t
                print(f"level {args.level} {m} batch {b}: "
                      + ", ".join(f"{k} {v}" for k, v in t.items()), flush=True)
                if args.kernels:
                    ks = step_kernels(engine, args.steps, args.kernels)
                    result.setdefault("kernels_us", {})[f"{m}/{b}"] = ks
                    for k in ks:
                        print(f"  {k['us']:8.2f} us {k['calls']:5.2f}x {k['name']}", flush=True)
                if args.cprofile:
                    prof = cProfile.Profile()
                    prof.runcall(lambda: [engine.step() for _ in range(args.steps)])
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(
                        args.cprofile)
                    print(text.getvalue(), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
