"""Cold vs warm compilation start, each in a fresh process (a new pod on a shared cache).

cold: an empty compile-cache directory (every piece compiled by Inductor);
warm: the directory a cold run filled (every piece loaded, nothing compiled).
Each run is a new Python process without a kernel cache of its own, as a fresh pod would be.

    .venv/bin/python bench/compile_bench.py --model toy --repeats 3
    .venv/bin/python bench/compile_bench.py --model llama --llama-name tiny-llama --repeats 3

Prints per-run numbers, the medians, and a markdown row for bench/RESULTS.md.
Goal (issue 3): warm start at most 20% of cold.

For the Llama model, --with-level0 also starts the same engine at level 0 (nothing compiled
or captured) and reports what compiling adds to the engine start, cold and warm: the compile
phase alone can look smaller than it is once some of its set-up overlaps the model build
(atom.compilation.prefetch), and this difference cannot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOY_WORKER = ROOT / "tests" / "runtime" / "test_compile_support.py"


def _fast_isa() -> None:
    """CPU only: skip Inductor's per-process ISA load probe (a Python start per ISA); the
    same constant in cold and warm runs, so leaving it out sharpens the comparison."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.VecISA._avx_py_load = "import sys\n"


def child(argv: list[str]) -> None:
    kind, rest = argv[0], argv[1:]
    if "--fast-isa" in rest:
        rest.remove("--fast-isa")
        _fast_isa()
    if kind == "toy":
        import importlib.util

        spec = importlib.util.spec_from_file_location("toy_worker", TOY_WORKER)
        assert spec and spec.loader
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.worker_main(rest)
    else:
        from atom.cli.main import main

        sys.exit(main(rest))


def child_args(kind: str, cache_dir: str, args: argparse.Namespace) -> list[str]:
    """This script's arguments for one run in a fresh process (after `python compile_bench.py`)."""
    cmd = ["--child", kind, *(["--fast-isa"] if args.fast_isa else [])]
    if kind == "toy":
        return cmd + ["--cache-dir", cache_dir, "--layers", str(args.layers), "--level", str(args.level)]
    return cmd + [
        "warmup", "--model", args.llama_name, "--load-format", "dummy", "--dtype", args.dtype,
        "--level", str(args.level), "--compile-cache-dir", cache_dir, "--max-num-seqs", "8",
        "--log-level", "warning",
    ]


def child_env() -> dict[str, str]:
    """No kernel cache of its own: Inductor's and Triton's caches live in the compile cache."""
    return {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}


def run_once(kind: str, cache_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, *child_args(kind, cache_dir, args)]
    env = child_env()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{kind} run failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")][-1]
    data = json.loads(line)
    if kind == "toy":
        compile_s = start_s = data["first_call_s"]
    else:
        # compile: torch.compile's first call (Dynamo or the saved trace, then Inductor or the
        # artifacts), what the cache can save; start: model build + warm-up (+ graph capture).
        compile_s = data["summary"]["compile_seconds"]
        start_s = data["build_seconds"] + data["warmup_seconds"]
    return {"wall_s": wall, "compile_s": compile_s, "start_s": start_s,
            "counters": data.get("counters", {})}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["toy", "llama"], default="toy")
    ap.add_argument("--llama-name", default="tiny-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2, help="toy model: split ops (pieces compiled = layers + 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--no-fast-isa", dest="fast_isa", action="store_false")
    ap.add_argument("--with-level0", action="store_true",
                    help="llama: also time the level-0 engine start and subtract it")
    args = ap.parse_args()
    if args.with_level0 and args.model != "llama":
        ap.error("--with-level0 needs --model llama")

    work = tempfile.mkdtemp(prefix="atom-compile-bench-")
    cold, warm = [], []
    warm_dir = os.path.join(work, "warm")
    for i in range(args.repeats):
        cold_dir = warm_dir if i == 0 else os.path.join(work, f"cold{i}")
        r = run_once(args.model, cold_dir, args)
        cold.append(r)
        print(f"cold {i}: compile {r['compile_s']:.2f}s  start {r['start_s']:.2f}s  process {r['wall_s']:.2f}s  {r['counters']}", flush=True)
    for i in range(args.repeats):
        r = run_once(args.model, warm_dir, args)
        warm.append(r)
        print(f"warm {i}: compile {r['compile_s']:.2f}s  start {r['start_s']:.2f}s  process {r['wall_s']:.2f}s  {r['counters']}", flush=True)

    def med(rows: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    c, w = med(cold, "compile_s"), med(warm, "compile_s")
    cw, ww = med(cold, "wall_s"), med(warm, "wall_s")
    ratio = w / c if c else float("nan")
    cs, ws = med(cold, "start_s"), med(warm, "start_s")
    print(f"median compile:       cold {c:.2f}s  warm {w:.2f}s  warm/cold {ratio:.0%}")
    print(f"median engine start:  cold {cs:.2f}s  warm {ws:.2f}s  warm/cold {ws / cs:.0%}")
    print(f"median process wall:  cold {cw:.2f}s  warm {ww:.2f}s  warm/cold {ww / cw:.0%}")
    if args.with_level0:
        base_args = argparse.Namespace(**{**vars(args), "level": 0})
        base = [run_once("llama", os.path.join(work, f"level0-{i}"), base_args)
                for i in range(args.repeats)]
        b = med(base, "start_s")
        print(f"median level-0 engine start {b:.2f}s; what compiling adds to it: cold "
              f"{cs - b:.2f}s  warm {ws - b:.2f}s  warm/cold {(ws - b) / (cs - b):.0%}")
    print(
        f"| {time.strftime('%Y-%m-%d')} | compile_bench --model {args.model} --level {args.level} "
        f"--repeats {args.repeats} | cold {c:.2f}s | warm {w:.2f}s | {ratio:.0%} |"
    )


if __name__ == "__main__":
    main()
