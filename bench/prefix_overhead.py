"""What prefix caching costs a decode step when nothing hits (issue 29: "decode step unchanged,
within 2%, at 0% hit rate"), measured in one engine, on and off interleaved.

The served comparison in prefix_bench.py runs two servers one after the other, so host noise
between them (the engine core is host-bound under load) swamps a 2% effect. Here one
`LLMEngine` runs batches of fresh random prompts (no shared block, so every lookup misses) with
`BlockManager.enable_prefix_caching` switched between rounds while the engine is idle (level 3,
TR_HYBRID, as served): the same process, the same graphs, the same KV cache, alternating on /
off --rounds times. Reported: the
median over rounds of the decode step (wall of the batch's steps after its prefill, over the
decode steps), per setting, and their ratio.

    python3 bench/prefix_overhead.py --out $OUT/prefix-overhead.json        # the H200
    python3 bench/prefix_overhead.py --quick                                # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

from common import MODEL, git_commit


def decode_step_ms(engine: Any, prompts: list[list[int]], output_len: int) -> float:
    """Mean ms of the decode steps of one batch (steps after the one that prefilled it)."""
    from atom.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"ab-{time.monotonic_ns()}-{i}", p, params)
    engine.step()  # the prefill
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) * 1000 / max(1, steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=MODEL)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=6, help="on/off pairs")
    p.add_argument("--quick", action="store_true", help="CPU: tiny-llama, float32, small")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from atom.config import Config
    from atom.engine import LLMEngine

    if args.quick:
        cfg = Config(
            model="tiny-llama",
            load_format="dummy",
            dtype="float32",
            device="cpu",
            max_model_len=256,
            max_num_seqs=8,
        )
        args.batch, args.prompt_len, args.output_len, args.rounds = 8, 64, 16, 2
    else:
        cfg = Config(
            model=args.model,
            load_format="dummy",
            dtype="bfloat16",
            max_model_len=args.prompt_len + args.output_len + 16,
            max_num_seqs=max(256, args.batch),
        )
    engine = LLMEngine(cfg)
    engine.warmup()
    bm = engine.block_manager
    rng = random.Random(0)
    vocab = 250

    def batch() -> list[list[int]]:
        return [
            [rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)
        ]

    decode_step_ms(engine, batch(), 8)  # first-use costs outside the rounds
    times: dict[str, list[float]] = {"on": [], "off": []}
    hits_before = bm.stats.hits
    for r in range(args.rounds):
        order = ("on", "off") if r % 2 == 0 else ("off", "on")
        for setting in order:
            bm.enable_prefix_caching = setting == "on"
            times[setting].append(decode_step_ms(engine, batch(), args.output_len))
    bm.enable_prefix_caching = True
    med = {k: statistics.median(v) for k, v in times.items()}
    report = {
        "benchmark": "prefix_overhead",
        "commit": git_commit(),
        "model": cfg.model,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rounds": args.rounds,
        "decode_step_ms": {k: [round(x, 4) for x in v] for k, v in times.items()},
        "median_ms": {k: round(v, 4) for k, v in med.items()},
        "on_over_off": round(med["on"] / med["off"], 4),
        "hit_tokens_during_rounds": bm.stats.hits - hits_before,  # must be 0: no shared block
    }
    print(json.dumps(report, indent=1))
    print(
        f"decode step at 0% hits: caching on {med['on']:.4f} ms, off {med['off']:.4f} ms, "
        f"ratio {report['on_over_off']:.4f} (target <= 1.02)",
        file=sys.stderr,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
