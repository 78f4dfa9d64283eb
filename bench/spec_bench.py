"""Speculative decoding: decode tokens/s with self-drafting (k = 1, 3, 5) and the n-gram
drafter against no speculation, in one run; and the verify step (k + 1 rows, batch 1) against
the one-row decode step (issue 30).

Workloads, per batch size:
- "plain": random prompts; self-drafting (the target as its own draft model) accepts every
  greedy draft, so its tokens/s is the mechanism's ceiling.
- "copy": prompts made of one random span repeated, whose continuation repeats it. With dummy
  weights the greedy answer is the model's, not the copy, so n-gram acceptance is whatever the
  model's own repetition gives: it is measured and reported, never assumed.
decode_tok_s = batch * (max_tokens - 1) / (t(max_tokens) - t(1)): the prefill (and its first
token) is timed separately and taken out. `identical` says whether the greedy tokens equal
those of the same run without speculation.

    python bench/spec_bench.py --out spec.json            # H200: llama-3.2-1b, bf16, FULL
    python bench/spec_bench.py --quick --out spec.json    # CPU smoke: tiny-llama, eager
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from typing import Any

import torch

from atom.config import CompilationConfig, Config
from atom.engine import LLMEngine, SamplingParams
from atom.engine.batch import SeqRows, StepBatch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _engine(args: argparse.Namespace, spec: dict | None) -> LLMEngine:
    cc = CompilationConfig(
        level=args.level,
        cudagraph_mode=args.mode,
        cudagraph_capture_sizes=sorted({1, 2, 4, 8, *args.batches}),
    )
    cfg = Config(
        model=args.model,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=max(8, *args.batches),
        num_kv_blocks=args.num_kv_blocks,
        compilation_config=cc,
        seed=0,
        speculative_config=spec,
        # Each rate is the difference of two generate() calls over the same prompts: a prefix
        # hit in the second would drop its prefill and void the difference.
        enable_prefix_caching=False,
    )
    e = LLMEngine(cfg)
    e.warmup()
    return e


def _prompts(kind: str, batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(batch):
        if kind == "copy":
            span = [rng.randrange(3, vocab) for _ in range(max(4, length // 4))]
            out.append((span * 4)[:length])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(length)])
    return out


def _timed(e: LLMEngine, prompts: list[list[int]], n: int, device: str) -> tuple[float, list]:
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    _sync(device)
    t0 = time.perf_counter()
    toks = e.generate(prompts, p)
    _sync(device)
    return time.perf_counter() - t0, toks


def decode_rate(e: LLMEngine, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    _timed(e, prompts, 4, args.device)  # warm: lazy compiles of these shapes
    t1, _ = _timed(e, prompts, 1, args.device)
    before = e.stats()
    tn, toks = _timed(e, prompts, args.max_tokens, args.device)
    after = e.stats()
    out: dict[str, Any] = {
        "decode_tok_s": len(prompts) * (args.max_tokens - 1) / max(tn - t1, 1e-9),
        "seconds": tn,
        "tokens": toks,
    }
    drafted = after.get("spec_decode_num_draft_tokens", 0) - before.get(
        "spec_decode_num_draft_tokens", 0
    )
    if drafted:
        acc = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        seqs = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        out["acceptance_rate"] = acc / drafted
        out["mean_accepted_tokens"] = (acc + seqs) / seqs
    for name in ("verify_graph_replays", "draft_graph_replays", "graph_replays", "eager_steps"):
        out[name] = after.get(name, 0) - before.get(name, 0)
    return out


@torch.inference_mode()
def step_ms(e: LLMEngine, rows: int, context: int, iters: int, device: str) -> float:
    """One target forward of `rows` query rows for one sequence of `context` cached tokens
    (the rows' keys written past them), through the engine's own dispatch (graphs included)."""
    bs = e.config.block_size
    table = list(range((context + rows + bs - 1) // bs))
    batch = StepBatch(
        [SeqRows("t", [5] * rows, context, table, None, True)],
        is_prefill=False,
        logits_all=rows > 1,
    )
    from atom.utils.forward_context import SpecDecodeMetadata

    spec = SpecDecodeMetadata(num_draft_tokens=[rows - 1]) if rows > 1 else None
    for _ in range(3):
        e.runner.execute_model(batch, spec=spec)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        e.runner.execute_model(batch, spec=spec)
    _sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--quick", action="store_true", help="CPU smoke: tiny-llama, level 0, no graphs"
    )
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--ngram-k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--context", type=int, default=512, help="verify-step timing: cached tokens")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--mode", default="FULL")
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.num_kv_blocks = 4096  # fixed: every engine of the run gets the same KV pool
    args.max_model_len = 1024
    if args.quick:
        args.model, args.level, args.mode = "tiny-llama", 0, "NONE"
        args.batches, args.ks, args.max_tokens, args.prompt_len = [1, 2], [1, 3], 24, 16
        args.context, args.iters, args.max_model_len, args.num_kv_blocks = 32, 5, 128, 64

    specs: dict[str, dict | None] = {"none": None}
    for k in args.ks:
        specs[f"self_k{k}"] = {
            "method": "draft_model",
            "model": args.model,
            "num_speculative_tokens": k,
        }
    specs[f"ngram_k{args.ngram_k}"] = {
        "method": "ngram",
        "num_speculative_tokens": args.ngram_k,
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
    }
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or "cpu",
        "args": vars(args),
        "runs": {},
        "verify_step_ms": {},
    }
    baseline_tokens: dict[str, list] = {}
    for name, spec in specs.items():
        e = _engine(args, spec)
        vocab = e.hf_config.vocab_size
        run: dict[str, Any] = {}
        for kind in ("plain", "copy"):
            for b in args.batches:
                key = f"{kind}_b{b}"
                r = decode_rate(e, _prompts(kind, b, args.prompt_len, vocab, seed=b), args)
                toks = r.pop("tokens")
                if spec is None:
                    baseline_tokens[key] = toks
                    r["identical"] = True
                else:
                    r["identical"] = toks == baseline_tokens[key]
                    base = results["runs"]["none"][key]["decode_tok_s"]
                    r["speedup"] = r["decode_tok_s"] / base
                run[key] = r
                print(
                    name,
                    key,
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()},
                    flush=True,
                )
        results["runs"][name] = run
        # verify step (k + 1 rows, batch 1) on this engine; the one-row step on the baseline
        rows = 1 if spec is None else spec["num_speculative_tokens"] + 1
        if spec is None or spec["method"] == "draft_model":
            results["verify_step_ms"][f"rows_{rows}"] = step_ms(
                e, rows, args.context, args.iters, args.device
            )
        del e
        _free()
    one = results["verify_step_ms"].get("rows_1")
    if one:
        results["verify_step_ratio"] = {k: v / one for k, v in results["verify_step_ms"].items()}
    print(
        json.dumps({k: results[k] for k in ("verify_step_ms", "verify_step_ratio") if k in results})
    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
