"""The real model on the GPU (issue 43): SmolLM2-135M-Instruct from its GGUF (Q4_1, dequantized
to bf16 at load), four measurements in one run.

1. parity: every level and graph mode, teacher-forced against transformers' own GGUF loading in
   fp32. Each engine generates greedy tokens for chat prompts; every step's logits are recorded
   at the sampler and compared with transformers fp32 over prompt + those tokens (the same
   positions). The yardstick is transformers in bf16 on the same sequences: our worst logit
   gap should be at most 2x its own. `top1` is the share of steps whose argmax equals fp32's.
   The counter delta proves the graphs were replayed (req/token graph replays, eager steps).
2. decode: tokens/s at batch 1 and 64 (--level, FULL_AND_TR_HYBRID, ignore_eos):
   batch * (n - 1) / (t(n) - t(1)), the prefill taken out.
3. spec: n-gram speculative decoding on copy-heavy real prompts (a paragraph to repeat with one
   change; a function to edit), batch 1 and 8: acceptance and tokens/s against no speculation
   in the same run, and whether the greedy tokens are identical.
4. chat: a multi-turn conversation (each turn's prompt is the whole history) with prefix caching
   on and off: the time to the first token per turn and the prefix hit rate.

    python3 bench/real_model_bench.py --gguf PATH.gguf --out real.json   # GPU
    python3 bench/real_model_bench.py --quick --out real.json            # CPU smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from atom.config import CompilationConfig, Config
from atom.engine import LLMEngine, SamplingParams
from atom.models.gguf_file import find_gguf
from atom.tokenizer import load_tokenizer
from atom.utils.counters import counters
from common import emit_report, git_commit

QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "How many days are in a week?",
    "What is the opposite of hot?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "What is 12 times 12?",
]
# (level, cudagraph mode): every level eager, then each graph mode at level 3 and FULL at 0.
MODES = [(0, "NONE"), (1, "NONE"), (2, "NONE"), (3, "NONE"), (0, "FULL"), (3, "TR_HYBRID"),
         (3, "FULL"), (3, "FULL_DECODE_ONLY"), (3, "FULL_AND_TR_HYBRID")]
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling in the salt "
    "wind. Every evening the keeper climbed the spiral stairs, trimmed the wick and lit the "
    "lamp, and every morning he wrote the weather in a leather book. Ships passed far out at "
    "sea, and none of them knew his name, but all of them knew his light."
)
FUNCTION = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
'''
COPY_TASKS = [
    f"Repeat the following paragraph exactly, but write 'lighthouse' as 'tower':\n\n{PARAGRAPH}",
    "Rewrite this Python function exactly, but rename the variable 'subtotal' to 'net':\n\n"
    f"{FUNCTION}",
]
CHAT_TURNS = [
    "Hi! I am planning a trip to Paris. What should I see first?",
    "How long should I stay there?",
    "What food should I try?",
    "Is the metro easy to use?",
    "What is a good day trip from the city?",
    "Thanks! Can you summarise your advice in three bullet points?",
]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine(args: argparse.Namespace, level: int, mode: str, **kw: Any) -> LLMEngine:
    cc = CompilationConfig(level=level, cudagraph_mode=mode, cache_dir=args.cache_dir,
                           cudagraph_capture_sizes=[1, 2, 4, 8, 16, 32, 64])
    # A fixed KV pool: engines made one after another in this process would each size theirs
    # from the memory left free by the ones before (CUDA graphs' pools outlive `del`).
    kw.setdefault("num_kv_blocks", args.kv_blocks)
    cfg = Config(model=args.gguf, dtype=args.dtype, device=args.device, max_model_len=2048,
                 max_num_seqs=64, compilation_config=cc, seed=0, **kw)
    e = LLMEngine(cfg)
    e.warmup()
    return e


def release(e: LLMEngine) -> None:
    """Give an engine's memory back before the next one is made."""
    e.shutdown()
    del e
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def chat_ids(tok: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def recorded_generate(e: LLMEngine, prompts: list[list[int]], n: int
                      ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens and every step's logits per prompt (recorded at the sampler)."""
    rec: dict[str, list[torch.Tensor]] = {}
    sample = e.sampler.sample

    def recording(logits, seqs, *a, **k):  # type: ignore[no-untyped-def]
        for row, seq in zip(logits, seqs, strict=False):
            rec.setdefault(seq.request_id, []).append(row.float().cpu())
        return sample(logits, seqs, *a, **k)

    e.sampler.sample = recording  # type: ignore[method-assign]
    try:
        outs = e.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    finally:
        del e.sampler.sample
    keys = sorted(rec, key=lambda r: int(r.rsplit("-", 1)[1]))
    return outs, [torch.stack(rec[k]) for k in keys]


def hf_models(args: argparse.Namespace) -> tuple[Any, Any]:
    import transformers

    path = Path(args.gguf)
    load = transformers.AutoModelForCausalLM.from_pretrained
    fp32 = load(path.parent, gguf_file=path.name, torch_dtype=torch.float32).to(args.device).eval()
    bf16 = load(path.parent, gguf_file=path.name, torch_dtype=torch.bfloat16).to(args.device).eval()
    return fp32, bf16


@torch.inference_mode()
def parity(args: argparse.Namespace, tok: Any, prompts: list[list[int]], hf32: Any, hf16: Any
           ) -> list[dict]:
    rows = []
    for level, mode in MODES:
        before = counters.snapshot()
        e = engine(args, level, mode)
        outs, steps = recorded_generate(e, prompts, args.parity_tokens)
        delta = counters.delta(before)
        ours_gap = hf_gap = 0.0
        agree = total = 0
        for prompt, out, got in zip(prompts, outs, steps, strict=True):
            ids = torch.tensor([prompt + out], device=args.device)
            lo, hi = len(prompt) - 1, len(prompt) - 1 + len(out)
            ref = hf32(ids).logits[0, lo:hi].float().cpu()
            half = hf16(ids).logits[0, lo:hi].float().cpu()
            ours_gap = max(ours_gap, (got - ref).abs().max().item())
            hf_gap = max(hf_gap, (half - ref).abs().max().item())
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += len(out)
        rows.append({
            "level": level, "mode": mode, "max_logit_gap": round(ours_gap, 4),
            "hf_bf16_max_logit_gap": round(hf_gap, 4),
            "gap_ratio": round(ours_gap / max(hf_gap, 1e-9), 3), "top1": round(agree / total, 4),
            "replays": {k: v for k, v in delta.items() if "replay" in k or k == "eager_steps"},
            "first_answer": tok.decode(outs[0]),
        })
        print(rows[-1], flush=True)
        release(e)
    return rows


def timed(e: LLMEngine, prompts: list[list[int]], params: SamplingParams, device: str
          ) -> tuple[float, list[list[int]]]:
    sync(device)
    t0 = time.perf_counter()
    out = e.generate(prompts, params)
    sync(device)
    return time.perf_counter() - t0, out


def decode(args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    e = engine(args, args.level, "FULL_AND_TR_HYBRID", enable_prefix_caching=False)
    out = {}
    for batch in args.decode_batches:
        ps = [prompts[i % len(prompts)] for i in range(batch)]
        greedy = dict(temperature=0.0, ignore_eos=True)
        timed(e, ps, SamplingParams(max_tokens=8, **greedy), args.device)
        t1 = statistics.median(timed(e, ps, SamplingParams(max_tokens=1, **greedy), args.device)[0]
                               for _ in range(3))
        tn = statistics.median(timed(e, ps, SamplingParams(max_tokens=args.decode_tokens, **greedy),
                                     args.device)[0] for _ in range(3))
        out[f"batch_{batch}"] = {"decode_tok_s": round(batch * (args.decode_tokens - 1) / (tn - t1), 1),
                                 "step_ms": round((tn - t1) / (args.decode_tokens - 1) * 1e3, 3)}
        print(batch, out[f"batch_{batch}"], flush=True)
    release(e)
    return out


def spec(args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    tasks = [chat_ids(tok, [{"role": "user", "content": t}]) for t in COPY_TASKS]
    res: dict[str, Any] = {}
    configs: dict[str, dict[str, Any] | None] = {"none": None}
    for k in args.ngram_k:
        configs[f"ngram_k{k}"] = {"method": "ngram", "num_speculative_tokens": k,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    reference: dict[int, list[list[int]]] = {}
    for name, sc in configs.items():
        e = engine(args, args.level, "FULL", enable_prefix_caching=False, speculative_config=sc)
        for batch in args.spec_batches:
            ps = [tasks[i % len(tasks)] for i in range(batch)]
            params = SamplingParams(temperature=0.0, max_tokens=args.spec_tokens)
            timed(e, ps, params, args.device)  # warm
            before = e.stats()
            secs, outs = timed(e, ps, params, args.device)
            after = e.stats()
            row: dict[str, Any] = {"tok_s": round(sum(map(len, outs)) / secs, 1),
                                   "tokens": sum(map(len, outs))}
            drafted = after.get("spec_decode_num_draft_tokens", 0) - before.get(
                "spec_decode_num_draft_tokens", 0)
            if drafted:
                acc = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
                row["acceptance_rate"] = round(acc / drafted, 4)
            if name == "none":
                reference[batch] = outs
            else:
                row["identical_to_none"] = outs == reference[batch]
                row["speedup"] = round(row["tok_s"] / res[f"none_b{batch}"]["tok_s"], 3)
            res[f"{name}_b{batch}"] = row
            print(name, batch, row, flush=True)
        if name == "none":
            res["answer_sample"] = tok.decode(reference[args.spec_batches[0]][0])[:400]
        release(e)
    return res


def chat(args: argparse.Namespace, tok: Any) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for caching in (True, False):
        e = engine(args, args.level, "FULL_AND_TR_HYBRID", enable_prefix_caching=caching)
        messages: list[dict[str, str]] = []
        ttft = []
        for turn in CHAT_TURNS:
            messages.append({"role": "user", "content": turn})
            ids = chat_ids(tok, messages)
            t, _ = timed(e, [ids], SamplingParams(temperature=0.0, max_tokens=1), args.device)
            ttft.append(round(t * 1e3, 2))
            _, (answer,) = timed(e, [ids], SamplingParams(temperature=0.0, max_tokens=64),
                                 args.device)
            messages.append({"role": "assistant", "content": tok.decode(answer)})
        st = e.stats()
        res["on" if caching else "off"] = {
            "ttft_ms_per_turn": ttft, "prompt_tokens_last_turn": len(ids),
            "prefix_cache_hit_rate": st.get("prefix_cache_hit_rate"),
        }
        print(caching, res["on" if caching else "off"], flush=True)
        release(e)
    res["last_turn_ttft_ratio_off_over_on"] = round(
        res["off"]["ttft_ms_per_turn"][-1] / res["on"]["ttft_ms_per_turn"][-1], 3)
    res["transcript_tail"] = messages[-1]["content"][:400]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="smollm2-135m-instruct", help="a .gguf file or built-in name")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", default=tempfile.mkdtemp(prefix="atom-real-"))
    ap.add_argument("--parts", nargs="+", default=["parity", "decode", "spec", "chat"],
                    choices=["parity", "decode", "spec", "chat"])
    ap.add_argument("--level", type=int, default=3, help="the decode, spec and chat engines' level")
    ap.add_argument("--kv-blocks", type=int, default=4096, help="each engine's KV pool (blocks)")
    ap.add_argument("--parity-tokens", type=int, default=32)
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--decode-tokens", type=int, default=129)
    ap.add_argument("--spec-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--spec-tokens", type=int, default=192)
    ap.add_argument("--ngram-k", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--quick", action="store_true", help="CPU smoke: fewer modes and tokens")
    ap.add_argument("--out")
    args = ap.parse_args()
    gguf = find_gguf(args.gguf)
    if gguf is None:
        raise SystemExit(f"--gguf {args.gguf}: no GGUF file found")
    args.gguf = str(gguf)
    if args.quick:
        global MODES
        MODES = [(0, "NONE"), (3, "NONE")]
        args.parity_tokens, args.decode_tokens, args.spec_tokens = 8, 9, 24
        args.decode_batches, args.spec_batches, args.ngram_k = [1, 4], [1], [3]
        args.level = 0
    tok = load_tokenizer(args.gguf, 0)
    prompts = [chat_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]
    report: dict[str, Any] = {
        "commit": git_commit(), "device": torch.cuda.get_device_name()
        if args.device == "cuda" else "cpu", "model": Path(args.gguf).name, "dtype": args.dtype,
        "torch": torch.__version__,
    }
    t0 = time.perf_counter()
    for part in args.parts:  # the report is rewritten after each part: a time limit keeps the rest
        if part == "parity":
            hf32, hf16 = hf_models(args)
            report["parity"] = parity(args, tok, prompts, hf32, hf16)
            del hf32, hf16
        elif part == "decode":
            report["decode"] = decode(args, prompts)
        elif part == "spec":
            report["spec"] = spec(args, tok)
        elif part == "chat":
            report["chat"] = chat(args, tok)
        report["seconds"] = round(time.perf_counter() - t0, 1)
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    emit_report(report, None)  # printed; the file was written after the last part


if __name__ == "__main__":
    main()
