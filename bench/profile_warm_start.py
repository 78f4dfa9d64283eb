"""Where a warm start's compile phase goes (issue 3): a stack sampler in one warm process.

Fills a compile cache with one cold `atom-runtime warmup` process (bench/compile_bench.py's
child), then runs a warm process with a thread that samples the main thread's Python stack
every --interval-ms and keeps the samples taken inside the engine's compile phase
(`ModelRunner.warmup_model`). Prints, per function, the share of samples with it on the stack
(inclusive) and at the top of the stack (own). A sampler, not cProfile: torch replaces the
profile hooks on this path and cProfile loses the frames.

    python bench/profile_warm_start.py --llama-name llama-3.2-1b --dtype bfloat16 --out prof.json
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import compile_bench

BENCH = Path(compile_bench.__file__).resolve()

PHASE = "warmup_model"


def warmup_cmd(args: argparse.Namespace, cache_dir: str) -> list[str]:
    return compile_bench.child_args("llama", cache_dir, argparse.Namespace(**vars(args), level=3))


def _frame_name(code: Any) -> str:
    path = code.co_filename
    for marker in ("site-packages/", "/runtime/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{code.co_firstlineno}({code.co_name})"


def sampled_child(out: str, interval_s: float, argv: list[str]) -> None:
    """Run compile_bench's child in this process while sampling the main thread's stack."""
    main_id = threading.get_ident()
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    samples = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(interval_s):
            frame = sys._current_frames().get(main_id)
            names = []
            while frame is not None:
                names.append(_frame_name(frame.f_code))
                frame = frame.f_back
            if not any(n.endswith(f"({PHASE})") for n in names):
                continue
            samples[0] += 1
            own[names[0]] += 1
            for n in set(names):
                inclusive[n] += 1

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        compile_bench.child(argv)
    except SystemExit:
        pass
    finally:
        stop.set()
        thread.join()
        Path(out).write_text(json.dumps({
            "interval_s": interval_s, "samples": samples[0],
            "inclusive": inclusive.most_common(), "own": own.most_common(),
        }))


def main() -> None:
    if len(sys.argv) > 3 and sys.argv[1] == "--sampled-child":
        sampled_child(sys.argv[2], float(sys.argv[3]), sys.argv[5:])  # argv[4] is "--child"
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-name", default="tiny-llama")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", required=True, help="JSON with the sample counts")
    ap.add_argument("--top", type=int, default=60)
    ap.add_argument("--interval-ms", type=float, default=2.0)
    ap.add_argument("--fast-isa", action="store_true", help="CPU: skip Inductor's ISA probe")
    args = ap.parse_args()
    cache_dir = tempfile.mkdtemp(prefix="atom-warm-profile-")
    subprocess.run([sys.executable, str(BENCH), *warmup_cmd(args, cache_dir)], check=True,
                   capture_output=True, env=compile_bench.child_env())
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--sampled-child", args.out,
                    str(args.interval_ms / 1000), *warmup_cmd(args, cache_dir)], check=True,
                   env=compile_bench.child_env())
    print(f"warm process: {time.perf_counter() - t0:.2f}s")
    data = json.loads(Path(args.out).read_text())
    n = max(data["samples"], 1)
    secs = data["interval_s"]
    print(f"{data['samples']} samples in {PHASE} (~{n * secs:.2f}s at {secs * 1000:.1f} ms)")
    for key in ("inclusive", "own"):
        print(f"\n===== {key} =====")
        for name, count in data[key][: args.top]:
            print(f"{100 * count / n:6.1f}%  {name}")


if __name__ == "__main__":
    main()
