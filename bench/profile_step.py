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
        [--staging kernel copies]  # the inputs staged by the kernel reading the host mirrors
                                   # and/or by copy-engine copies, alternately, in one run
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import decode_bench as db
import step_timeline as st
from common import sync

PHASES = ("schedule", "prepare", "launch", "sample", "read")
# The step's own kernels around the forward: atom.kernels.triton_copy's staging of the inputs.
STEP_KERNELS = ("_stage_kernel",)
# A greedy step's last GPU activity (the bench's steps are greedy): the argmax, which also
# writes the sampled ids into pinned host memory; before that a copy to the host.
STEP_ENDS = ("_argmax_kernel", "_copy_kernel", "Memcpy DtoH")


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


def step_kernels(engine: Any, steps: int, top: int
                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The `top` GPU activities (kernels, copies) of `steps` engine steps by time, us and
    calls per step (torch.profiler): with profile_decode's forward, what a step adds; and
    the last step's activities in order (last_step)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        engine.step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        sync()
    per, timeline = st.gpu_activities(prof.events())
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"name": k, "calls": round(c / steps, 2), "us": round(u / steps, 2)}
            for k, (c, u) in rows], last_step(sorted(timeline, key=lambda k: k.start_us))


def last_step(timeline: list[st.Kernel]) -> list[dict[str, Any]]:
    """The GPU activities of the last whole step (after the second-to-last copy of sampled
    ids to the host, up to the last), with the idle time before each; the forward's
    own kernels (Triton's `_...` and Inductor's `triton_...`, less the step's) folded into
    one entry."""
    ends = [i for i, k in enumerate(timeline) if k.name.startswith(STEP_ENDS)]
    if len(ends) < 2:
        return []
    out: list[dict[str, Any]] = []
    prev_end = timeline[ends[-2]].end_us
    for name, start, end in timeline[ends[-2] + 1:ends[-1] + 1]:
        forward = (name.startswith(("_", "triton_"))
                   and not name.startswith(STEP_KERNELS + STEP_ENDS))
        if forward and out and out[-1]["name"] == "forward kernels":
            out[-1]["us"] = round(end - out[-1]["start"], 2)
            out[-1]["count"] += 1
        else:
            out.append({"name": "forward kernels" if forward else name, "start": start,
                        "us": round(end - start, 2), "idle_before": round(start - prev_end, 2),
                        "count": 1})
        prev_end = max(prev_end, end)
    base = out[0]["start"] - out[0]["idle_before"] if out else 0.0
    for row in out:
        row["start"] = round(row["start"] - base, 2)
    return out


def main() -> None:
    ap = db.profile_parser(__doc__, level=0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sync", action="store_true", help="synchronous steps (async_scheduling off)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also list the N GPU activities taking the most time per step")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the N host functions with the most own time over the steps")
    ap.add_argument("--staging", nargs="+", choices=["kernel", "copies"], default=["kernel"],
                    help="how the step's inputs reach the device (host_staging."
                         "DEVICE_READS_MIRRORS); several: each in turn, keys suffixed /NAME")
    args = ap.parse_args()
    from atom.config import CUDAGraphMode
    from atom.engine import host_staging

    engine, result = db.profile_setup(args.level, args.batches, args.context, "phases_us",
                                      args.max_model_len)
    engine.async_scheduling = not args.sync
    result["async_scheduling"] = engine.async_scheduling
    runners = {m: db.capture(engine, CUDAGraphMode.parse(m), sorted(args.batches))[0]
               for m in args.modes}
    for b in args.batches:
        with db.filled_batch(engine, b, args.context):
            for m, staging in ((m, s) for m in args.modes for s in args.staging):
                host_staging.DEVICE_READS_MIRRORS = staging == "kernel"
                key = f"{m}/{b}" + (f"/{staging}" if len(args.staging) > 1 else "")
                engine.runner.graph_runner = runners[m]
                t = phase_table(engine, args.steps)
                result["phases_us"][key] = t
                print(f"level {args.level} {key}: "
                      + ", ".join(f"{k} {v}" for k, v in t.items()), flush=True)
                if args.kernels:
                    ks, step = step_kernels(engine, args.steps, args.kernels)
                    result.setdefault("kernels_us", {})[key] = ks
                    result.setdefault("last_step", {})[key] = step
                    for k in ks:
                        print(f"  {k['us']:8.2f} us {k['calls']:5.2f}x {k['name']}", flush=True)
                    print("  the last step (us: start, length, idle before):")
                    for r in step:
                        print(f"  {r['start']:8.2f} {r['us']:8.2f} {r['idle_before']:7.2f}  "
                              f"{r['count']}x {r['name']}", flush=True)
                if args.cprofile:
                    prof = cProfile.Profile()
                    prof.runcall(lambda: [engine.step() for _ in range(args.steps)])
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(
                        args.cprofile)
                    print(text.getvalue(), flush=True)
    result["staging"] = args.staging
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
