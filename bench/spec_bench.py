"""Speculative decoding: decode tokens/s with self-drafting (k = 1, 3, 5) and the n-gram
drafter against no speculation, in one run; and the verify step (k + 1 rows, batch 1) against
the one-row decode step (issue 30).

Workloads, per batch size:
- "plain": random prompts; self-drafting (the target as its own draft model) accepts every
  greedy draft, so its tokens/s is the mechanism's ceiling.
- "copy": copy-heavy, on a constructed token-chain model of the same shape (bench/copy_chain.py):
  dummy random weights cannot copy (on the H200 a random llama-3.2-1b's answers had 127
  distinct tokens of 128 and the n-gram drafter accepted nothing), so after the plain
  workload and the verify-step timing each engine's weights are rewritten in place (same
  chain, same seed: identical targets) so that the greedy successor of each of n chain tokens
  (--chain-n, 2048; 64 under --quick) is the next token of one cycle. Each prompt is a chain
  span of max_tokens + 32 tokens, a break of 8 random chain tokens, then the span's first 4
  tokens again: the greedy answer is the rest of the span, a span of the prompt, which is
  what the n-gram drafter copies. The
  engine is the 1B model's (the same parameter tensors, shapes, kernels and graphs, every
  layer's attention and MLP still run, into zero output projections but layer 0's MLP), so
  the timing is the real engine's; only the weights' values differ.
  The expected answer is the chain on the host; `matches_expected_answer` says how much of
  it each engine generated (1.0 for no speculation, or the construction is wrong), and
  `chain_model` the construction's logit margin in the model's dtype (every chain token,
  whole vocabulary). Self-draft engines get the construction on their draft model too (the
  target stays its own draft). The acceptance comes from the engine's spec stats, and
  `ngram_hit_rate` is the share of the answer an n-gram lookup of the expected text proposes.
decode_tok_s = batch * (max_tokens - 1) / (t(max_tokens) - t(1)): the prefill (and its first
token) is timed separately and taken out. `identical` says whether the greedy tokens equal
those of the same run without speculation.

The verify step of k + 1 rows is a decode step of k + 1 one-token rows (atom.spec_decode.
decoder), timed at 1, 2, 4 and 6 rows through the engine's own dispatch (graphs included).
Self-drafting has an arithmetic ceiling: with a draft that costs one target step per token,
k drafts and one verify give at most (k + 1) / (k + verify/step) of the no-speculation rate,
which is below 1 whenever a verify costs more than a step (and a fully accepted step adds one
more draft pass, the last draft's own keys). Issue 30's "self-draft k = 3 >= 2x" therefore
cannot be met by construction: self-drafting measures the mechanism's overhead, and only a
draft far cheaper than the target (or the n-gram drafter on copy-heavy text) can gain.
`batch_invariance` reports whether a plain decode row's logits at batch 1 equal, bit for bit,
its logits inside plain decode batches of 4 and 8 (the kernels pick their launches by the row
count, so they need not; a verify's rows launch for its requests instead).

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
from atom.spec_decode.ngram import NgramDrafter
from atom.utils.forward_context import SpecDecodeMetadata
from copy_chain import Chain, apply_chain, copy_prompts


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def build_engine(args: argparse.Namespace, spec: dict | None) -> LLMEngine:
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


def _random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def copy_workload(chain: Chain, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """The chain model's copy prompts and expected answers (copy_chain.copy_prompts);
    `ngram_hit_rate`: the share of answer tokens the n-gram drafter's first proposal gets
    right, reading the prompt and the expected answer so far."""
    prompts, expected = copy_prompts(chain, batch, args.max_tokens, 1000 + batch)
    drafter = NgramDrafter(1, 1, 3)
    hits = sum(
        drafter.propose(pr + ex[:j])[0] == ex[j]
        for pr, ex in zip(prompts, expected, strict=True)
        for j in range(len(ex))
    )
    return {
        "prompts": prompts,
        "expected": expected,
        "prompt_len": len(prompts[0]),
        "ngram_hit_rate": hits / max(1, sum(len(x) for x in expected)),
        "distinct_answer_tokens": [len(set(x)) for x in expected],
    }


def to_chain(e: LLMEngine, chain: Chain) -> dict[str, Any]:
    """The engine's model (and a draft model's) made the chain model, in place; margins."""
    out = {"target": apply_chain(e.runner.model, chain)}
    if e.draft_runner is not None:
        out["draft"] = apply_chain(e.draft_runner.model, chain)
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
    for name in ("verify_graph_replays", "draft_graph_replays", "graph_replays", "eager_steps",
                 "spec_decode_steps", "spec_decode_no_draft_steps"):
        out[name] = after.get(name, 0) - before.get(name, 0)
    return out


def _rows(rows: int, context: int, block_size: int, requests: int = 1) -> list:
    """Each request's rows at positions context .. context + rows - 1 (a verify's layout), on
    blocks of its own."""
    per = (context + rows + block_size - 1) // block_size
    return [
        SeqRows(str(r), [5], context + i, list(range(r * per, (r + 1) * per)), None, True)
        for r in range(requests)
        for i in range(rows)
    ]


@torch.inference_mode()
def step_ms(
    e: LLMEngine, rows: int, context: int, iters: int, device: str, requests: int = 1
) -> float:
    """One target forward of `rows` rows for each of `requests` requests of `context` cached
    tokens: a decode step (rows 1) or a verify of rows - 1 drafts, through the engine's own
    dispatch."""
    batch = StepBatch(_rows(rows, context, e.config.block_size, requests), is_prefill=False)
    spec = SpecDecodeMetadata(num_draft_tokens=[rows - 1] * requests) if rows > 1 else None
    for _ in range(3):
        e.runner.execute_model(batch, spec=spec)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        e.runner.execute_model(batch, spec=spec)
    _sync(device)
    return (time.perf_counter() - t0) / iters * 1e3


@torch.inference_mode()
def batch_invariance(e: LLMEngine, context: int) -> dict[str, Any]:
    """Request 0's decode logits alone against inside plain decode batches of 4 and 8 (the
    other requests on disjoint blocks): bitwise equal or not, and the largest difference."""
    bs = e.config.block_size
    per = (context + bs) // bs + 1

    def logits(n: int) -> torch.Tensor:
        rows = []
        for i in range(n):
            table = list(range(i * per, (i + 1) * per))
            rows.append(SeqRows(str(i), [5 + i], context - 7 * i, table, None, True))
        out, _ = e.runner.execute_model(StepBatch(rows, is_prefill=False))
        return out[0].float().clone()

    alone = logits(1)
    out: dict[str, Any] = {}
    for n in (4, 8):
        other = logits(n)
        out[f"batch_{n}"] = {
            "bitwise_equal": bool(torch.equal(alone, other)),
            "max_abs_diff": float((alone - other).abs().max()),
        }
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _specs(args: argparse.Namespace) -> dict[str, dict | None]:
    specs: dict[str, dict | None] = {"none": None}
    for k in args.ks:
        specs[f"self_k{k}"] = {
            "method": "draft_model",
            "model": args.model,
            "num_speculative_tokens": k,
        }
    for k in args.ngram_k:
        for lo in args.ngram_min:
            specs[f"ngram_k{k}" + (f"_min{lo}" if lo != 1 else "")] = {
                "method": "ngram",
                "num_speculative_tokens": k,
                "prompt_lookup_min": lo,
                "prompt_lookup_max": max(3, lo),
            }
    return specs


def ceilings(verify_ms: dict[str, float], ks: list[int]) -> dict[str, dict[str, float]]:
    """Self-drafting's best rate against none, from the measured verify/step ratio:
    (k + 1) / (k + ratio), and with the catch-up pass of a fully accepted step."""
    one = verify_ms.get("rows_1")
    out = {}
    for k in ks:
        v = verify_ms.get(f"rows_{k + 1}")
        if one and v:
            r = v / one
            out[f"self_k{k}"] = {
                "verify_over_step": r,
                "ceiling": (k + 1) / (k + r),
                "ceiling_with_catch_up_pass": (k + 1) / (k + 1 + r),
            }
    return out


def _measure(
    e: LLMEngine,
    name: str,
    key: str,
    prompts: list[list[int]],
    spec: dict | None,
    results: dict[str, Any],
    baseline_tokens: dict[str, list],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One workload's decode rate on `e`, its tokens against no speculation's (the baseline
    run records them) and, for a copy workload, against the expected answers."""
    r = decode_rate(e, prompts, args)
    toks = r.pop("tokens")
    if spec is None:
        baseline_tokens[key] = toks
        r["identical"] = True
    else:
        r["identical"] = toks == baseline_tokens[key]
        r["speedup"] = r["decode_tok_s"] / results["runs"]["none"][key]["decode_tok_s"]
    if key.startswith("copy"):
        want = baseline_tokens[f"expected_{key}"]
        same = sum(
            a == b for t, w in zip(toks, want, strict=True) for a, b in zip(t, w, strict=False)
        )
        r["matches_expected_answer"] = same / max(1, sum(len(w) for w in want))
    print(
        name, key, {k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}, flush=True
    )
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--quick", action="store_true", help="CPU smoke: tiny-llama, level 0, no graphs"
    )
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 3, 5], help="self-draft k (none: -)")
    ap.add_argument("--ngram-k", type=int, nargs="*", default=[3, 5])
    ap.add_argument("--ngram-min", type=int, nargs="+", default=[1],
                    help="n-gram prompt_lookup_min values (lookup max: 3, or the min if larger)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--context", type=int, default=512, help="verify-step timing: cached tokens")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--mode", default="FULL")
    ap.add_argument("--chain-n", type=int, default=2048, help="copy workload: chain tokens")
    ap.add_argument("--chain-seed", type=int, default=0)
    args = ap.parse_args()
    args.device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.num_kv_blocks = 4096  # fixed: every engine of the run gets the same KV pool
    args.max_model_len = 1024
    if args.quick:
        args.model, args.level, args.mode = "tiny-llama", 0, "NONE"
        args.batches, args.ks, args.max_tokens, args.prompt_len = [1, 2], [1, 3], 24, 16
        args.context, args.iters, args.max_model_len, args.num_kv_blocks = 32, 5, 128, 64
        args.chain_n = 64  # of tiny-llama's 256 ids and 128 MLP channels
        args.ngram_k = [3]

    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name()
        if args.device == "cuda"
        else platform.processor() or "cpu",
        "args": vars(args),
        "runs": {},
        "verify_step_ms": {},
        "verify_step_ms_batch": {},  # the same at the largest batch (rows per request)
        "copy_workload": {},
        "chain_model": {},  # per engine: the chain construction's margin (copy_chain.margin)
    }
    baseline_tokens: dict[str, list] = {}
    plain: dict[str, list[list[int]]] = {}
    copy: dict[str, list[list[int]]] = {}
    for name, spec in _specs(args).items():
        e = build_engine(args, spec)
        if spec is None:
            for b in args.batches:
                plain[f"plain_b{b}"] = _random_prompts(
                    b, args.prompt_len, e.hf_config.vocab_size, b
                )
            results["batch_invariance"] = batch_invariance(e, args.context)
            print("batch_invariance", results["batch_invariance"], flush=True)
        run: dict[str, Any] = {}
        for key, prompts in plain.items():
            run[key] = _measure(e, name, key, prompts, spec, results, baseline_tokens, args)
        # verify step (k + 1 rows, batch 1) on this engine; the one-row step on the baseline
        rows = 1 if spec is None else spec["num_speculative_tokens"] + 1
        if spec is None or spec["method"] == "draft_model":
            results["verify_step_ms"][f"rows_{rows}"] = step_ms(
                e, rows, args.context, args.iters, args.device
            )
            results["verify_step_ms_batch"][f"rows_{rows}"] = step_ms(
                e, rows, args.context, args.iters, args.device, max(args.batches)
            )
        # The copy workload: the same engine (compiled code, graphs) as the chain model.
        hf = e.hf_config
        avoid = {*hf.eos_token_id, *([hf.bos_token_id] if hf.bos_token_id is not None else [])}
        chain = Chain.draw(hf.vocab_size, args.chain_n, args.chain_seed, avoid)
        results["chain_model"][name] = to_chain(e, chain)
        print(name, "chain_model", results["chain_model"][name], flush=True)
        if spec is None:
            for b in args.batches:
                cw = copy_workload(chain, b, args)
                copy[f"copy_b{b}"] = cw.pop("prompts")
                baseline_tokens[f"expected_copy_b{b}"] = cw.pop("expected")
                results["copy_workload"][f"b{b}"] = cw
        for key, prompts in copy.items():
            run[key] = _measure(e, name, key, prompts, spec, results, baseline_tokens, args)
        results["runs"][name] = run
        del e
        _free()
    one = results["verify_step_ms"].get("rows_1")
    if one:
        results["verify_step_ratio"] = {k: v / one for k, v in results["verify_step_ms"].items()}
    results["self_draft_ceiling"] = ceilings(results["verify_step_ms"], args.ks)
    shown = (
        "verify_step_ms",
        "verify_step_ratio",
        "verify_step_ms_batch",
        "self_draft_ceiling",
        "copy_workload",
        "chain_model",
    )
    print(json.dumps({k: results[k] for k in shown if k in results}, indent=1))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
