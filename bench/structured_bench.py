"""Structured output's cost on the decode step (issue 45): SmolLM2-135M-Instruct (its 49,152-token
vocabulary), the same batch decoded with 0% and 100% of its rows constrained, in one run.

Every row decodes greedily with ignore_eos for --tokens tokens. Constrained rows follow a grammar
that stays open for the whole run, so every step fills and applies a real mask: `regex` (300+
letters, a character class the matcher checks against the whole vocabulary) or `json` (an object
with a free-text field). Reported per batch size: the median decode step (ms) free and
constrained, the difference, and the mask's own time per step: the fill on the host
(StructuredHost.step_mask) and the apply to the logits (StepMask.apply, in the sampler; on CUDA
its launch, the kernel runs on the stream).

    python3 bench/structured_bench.py --device cpu --batches 1 8 --out structured.json
    python3 bench/structured_bench.py --device cuda --batches 1 64 --level 3   # GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from atom.config import CompilationConfig, Config
from atom.engine import LLMEngine, SamplingParams
from atom.structured.bitmask import StepMask
from atom.structured.host import StructuredHost
from atom.structured.spec import StructuredKind, StructuredSpec
from common import emit_report, git_commit

MODEL = "smollm2-135m-instruct"
GRAMMARS = {
    "regex": StructuredSpec(StructuredKind.REGEX, "[A-Za-z ,.]{300,400}"),
    "json": StructuredSpec(StructuredKind.JSON, json.dumps({
        "type": "object", "properties": {"description": {"type": "string"}},
        "required": ["description"]})),
}
PROMPT = "Describe the city of Paris in a long paragraph."


def _timed_steps(engine: LLMEngine, batch: int, tokens: int,
                 spec: StructuredSpec | None) -> list[float]:
    """Seconds per engine step once every row is decoding (the prefill step left out)."""
    prompt = _prompt_ids(engine)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}-{spec is not None}", prompt, SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, structured=spec))
    times = []
    first = True
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        if not first:
            times.append(time.perf_counter() - t0)
        first = False
    return times[:-1]  # the last read ends the run, with nothing launched


_PROMPT_IDS: list[int] = []


def _prompt_ids(engine: LLMEngine) -> list[int]:
    if not _PROMPT_IDS:
        from atom.tokenizer import load_tokenizer

        tok = load_tokenizer(MODEL, engine.hf_config.vocab_size)
        text = tok.apply_chat_template([{"role": "user", "content": PROMPT}])
        _PROMPT_IDS.extend(tok.encode(text, add_special_tokens=False))
    return _PROMPT_IDS


def _mask_time(host: StructuredHost) -> tuple[Callable[[], None], list[float], list[float]]:
    """Time host.step_mask (the fill) and StepMask.apply; returns the undo and the samples."""
    fills: list[float] = []
    applies: list[float] = []
    inner, inner_apply = host.step_mask, StepMask.apply

    def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kw)
        if out is not None:
            fills.append(time.perf_counter() - t0)
        return out

    def timed_apply(self: StepMask, logits: Any) -> Any:
        t0 = time.perf_counter()
        out = inner_apply(self, logits)
        applies.append(time.perf_counter() - t0)
        return out

    host.step_mask = timed  # type: ignore[method-assign]
    StepMask.apply = timed_apply  # type: ignore[method-assign]

    def undo() -> None:
        host.step_mask = inner  # type: ignore[method-assign]
        StepMask.apply = inner_apply  # type: ignore[method-assign]

    return undo, fills, applies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--level", type=int, default=0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3, help="free/constrained run pairs")
    ap.add_argument("--grammar", choices=sorted(GRAMMARS), nargs="+", default=["regex", "json"])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    engine = LLMEngine(Config(model=MODEL, load_format="auto", dtype=args.dtype,
                              device=args.device, max_model_len=1024,
                              compilation_config=CompilationConfig(level=args.level),
                              max_num_seqs=max(args.batches)))
    engine.warmup()
    _timed_steps(engine, 1, 4, None)  # a first run: lazy allocations out of the numbers
    rows = []
    for batch in args.batches:
        for name in args.grammar:
            spec = GRAMMARS[name]
            engine.structured.cache.get(spec)  # compiled before timing
            # Free and constrained runs alternate, so a drift in the machine's load hits both.
            free_steps: list[float] = []
            constrained_steps: list[float] = []
            fills: list[float] = []
            applies: list[float] = []
            for _ in range(args.repeats):
                free_steps += _timed_steps(engine, batch, args.tokens, None)
                undo, fill, apply = _mask_time(engine.structured)
                constrained_steps += _timed_steps(engine, batch, args.tokens, spec)
                undo()
                fills += fill
                applies += apply
            free = statistics.median(free_steps)
            constrained = statistics.median(constrained_steps)
            row = {"batch": batch, "grammar": name, "free_step_ms": round(free * 1e3, 2),
                   "constrained_step_ms": round(constrained * 1e3, 2),
                   "slower_pct": round((constrained / free - 1) * 100, 1),
                   "mask_fill_ms": round(statistics.median(fills) * 1e3, 3),
                   "mask_apply_ms": round(statistics.median(applies) * 1e3, 3)}
            rows.append(row)
            print(row, flush=True)
    report = {"bench": "structured_output", "model": MODEL, "device": args.device,
              "dtype": args.dtype, "level": args.level, "tokens": args.tokens,
              "commit": git_commit(), "rows": rows}
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
