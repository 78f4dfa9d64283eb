"""Where a decode step's time goes on the GPU (issue 5): kernel times per graph replay and the
bandwidth each linear layer's GEMM reaches on its own.

For each batch: builds the level-3 engine once (bench/decode_bench.py helpers), records FULL
graphs, then profiles --iters replays of run_model with torch.profiler and reports per kernel
name: calls per step, microseconds per step, share of the step; the sum of kernel time per step
against the wall time (the difference is GPU idle: launch gaps, host work). Also times each
weight shape's GEMM in a CUDA graph alone and reports its achieved bytes/s.

    python bench/profile_decode.py --out profile.json [--batches 1 8 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_bench as db  # noqa: E402


def gemm_rates(batches: list[int], iters: int = 200) -> list[dict[str, Any]]:
    """Achieved bytes/s of F.linear per weight shape of the model, each in its own graph."""
    from atom.models.registry import load_model_config

    c = load_model_config(db.MODEL)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"qkv": (q + 2 * kv, c.hidden_size), "o": (c.hidden_size, q),
              "gate_up": (2 * c.intermediate_size, c.hidden_size),
              "down": (c.hidden_size, c.intermediate_size),
              "lm_head": (c.vocab_size, c.hidden_size)}
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for b in batches:
            x = torch.randn(b, k, device="cuda", dtype=torch.bfloat16)
            torch.nn.functional.linear(x, w)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                torch.nn.functional.linear(x, w)
                with torch.cuda.graph(g):
                    for _ in range(10):
                        y = torch.nn.functional.linear(x, w)
            torch.cuda.current_stream().wait_stream(s)
            del y
            g.replay()
            db._sync()
            t0 = time.perf_counter()
            for _ in range(iters):
                g.replay()
            db._sync()
            us = (time.perf_counter() - t0) / iters / 10 * 1e6
            rate = w.numel() * 2 / (us * 1e-6)
            out.append({"weight": name, "n": n, "k": k, "batch": b, "us": round(us, 2),
                        "TBps": round(rate / 1e12, 3)})
            print(f"gemm {name:>8} [{n}x{k}] batch {b:>3}: {us:7.2f} us, "
                  f"{rate / 1e12:5.2f} TB/s", flush=True)
        del w
    return out


def kernel_table(engine: Any, iters: int) -> dict[str, Any]:
    """Profile iters run_model calls of the prepared decode batch; per-kernel us per step."""
    from torch.profiler import ProfilerActivity, profile

    with db.prepared_decode(engine) as (runner, input_ids, idx):
        for _ in range(5):
            runner.run_model(input_ids, idx)
        db._sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            runner.run_model(input_ids, idx)
        db._sync()
        wall_us = (time.perf_counter() - t0) / iters * 1e6
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                runner.run_model(input_ids, idx)
            db._sync()
    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = per[ev.name[:90]]
            rec[0] += 1
            rec[1] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time
    total = sum(v[1] for v in per.values()) / iters
    rows = sorted(((k, v[0] / iters, v[1] / iters) for k, v in per.items()),
                  key=lambda r: -r[2])
    return {"wall_us": round(wall_us, 1), "kernel_us": round(total, 1),
            "kernels_per_step": round(sum(r[1] for r in rows), 1),
            "kernels": [{"name": k, "calls": round(c, 2), "us": round(u, 2),
                         "share": round(u / total, 4) if total else 0} for k, c, u in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--modes", nargs="+", default=["FULL"])
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-gemm", action="store_true")
    args = ap.parse_args()
    from atom.config import CUDAGraphMode

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "level": args.level, "profiles": {}}
    if not args.no_gemm:
        result["gemm"] = gemm_rates(args.batches)
    max_bs = max(args.batches)
    blocks = max_bs * ((args.context + 1024) // 16 + 2) + 64
    engine, _, _ = db.build_engine(args.level, max_bs, args.context, blocks)
    runners = {m: db.capture(engine, CUDAGraphMode.parse(m), sorted(args.batches))[0]
               if m != "NONE" else None for m in args.modes}
    for b in args.batches:
        engine.runner.graph_runner = None
        db.fill_batch(engine, b, args.context)
        for m in args.modes:
            engine.runner.graph_runner = runners[m]
            t = kernel_table(engine, args.iters)
            result["profiles"][f"{m}/{b}"] = t
            print(f"\n== level {args.level} {m} batch {b}: wall {t['wall_us']} us/step, "
                  f"kernels {t['kernel_us']} us/step ({t['kernels_per_step']} launches)")
            for r in t["kernels"][:25]:
                print(f"  {r['us']:8.2f} us {100 * r['share']:5.1f}%  x{r['calls']:<5} "
                      f"{r['name']}")
        engine.runner.graph_runner = None
        db.drain(engine)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
