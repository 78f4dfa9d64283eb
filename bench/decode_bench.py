"""Decode-step latency of the engine per graph mode and level, against transformers and the
memory-bandwidth bound (issue 5).

Model: the Llama-3.2-1B shape (built-in `llama-3.2-1b`), bf16 dummy weights; every sequence
holds --context tokens. For each level, one engine is compiled once and the graph modes are
swapped on it (GraphRunner with a mode override), so the modes run the same compiled code:
- forward_ms: ModelRunner.run_model on one prepared decode batch (replay or eager forward +
  logits), timed over --iters back-to-back calls between two synchronisations;
- step_ms: a whole LLMEngine.step() (scheduling, input preparation, forward, sampling), the
  engine's default asynchronous steps (each launched before the last is read): --steps steps
  from one synchronisation to the next, over their count. That span also holds the pipeline's
  fill once (the GPU idles while the host prepares the first step), spread over the steps;
- steady_step_ms: the same steps in steady state, without that fill: the GPU time between
  events recorded on the stream after the first step and after the last (host gaps that the
  GPU waits for between them are in it);
- step_sync_ms: the same with Config.async_scheduling off (each step ends with its tokens on
  the host), for comparison.
Also: transformers generate() with a static cache (which compiles the forward with
torch.compile) on the same shapes, per step the median of 5 timed pairs; the bound (weight +
KV bytes) / measured copy rate; the capture time of the default ladder (1-8, 16..512).

    python bench/decode_bench.py --out results.json [--batches 1 8 64] [--levels 0 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from common import MODEL, copy_rate_bytes_per_s, git_commit, projection_shapes, sync

DEFAULT_LADDER = list(range(1, 9)) + list(range(16, 513, 16))


def shape_bytes(context: int) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of the bf16 model shape, counted from its config."""
    from atom.models.registry import load_model_config

    c = load_model_config(MODEL)
    kv = c.num_key_value_heads * c.head_dim
    per_layer = sum(n * k for n, k in projection_shapes(c).values()) + 2 * c.hidden_size
    params = c.num_hidden_layers * per_layer + c.hidden_size \
        + c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return 2 * params, 2 * c.num_hidden_layers * kv * 2


def bound_ms(weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int,
             rate: float) -> float:
    """Each decode step reads every weight once and each sequence's KV cache once."""
    return (weight_bytes + kv_bytes_per_token * batch * context) / rate * 1e3


# --------------------------------------------------------------------------- our engine


def build_engine(level: int, max_num_seqs: int, context: int, num_kv_blocks: int,
                 max_model_len: int | None = None):
    """The engine on dummy weights; max_model_len (default context + 1024) sets the width of
    the block tables (and at least one sequence's worth of KV blocks: the engine's check)."""
    from atom.config import CompilationConfig, Config, CUDAGraphMode
    from atom.engine.llm_engine import LLMEngine

    if max_model_len:
        num_kv_blocks = max(num_kv_blocks, -(-max_model_len // 16) + 2)

    cfg = Config(model=MODEL, load_format="dummy", dtype="bfloat16", device="cuda",
                 max_num_seqs=max_num_seqs, max_model_len=max_model_len or context + 1024,
                 max_num_batched_tokens=8192, num_kv_blocks=num_kv_blocks,
                 compilation_config=CompilationConfig(
                     level=level, cudagraph_mode=CUDAGraphMode.NONE))
    t0 = time.perf_counter()
    engine = LLMEngine(cfg)
    summary = engine.warmup()  # compiles at level 3; mode NONE captures nothing
    return engine, time.perf_counter() - t0, summary


def kv_blocks(max_bs: int, context: int) -> int:
    """KV blocks for max_bs sequences of `context` tokens and 1024 more (the model length)."""
    return max_bs * ((context + 1024) // 16 + 2) + 64


def profile_parser(doc: str, level: int) -> argparse.ArgumentParser:
    """The profiling scripts' shared flags (their own are added after)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--modes", nargs="+", default=["FULL"])
    ap.add_argument("--level", type=int, default=level)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len (default: context + 1024)")
    return ap


def profile_setup(level: int, batches: list[int], context: int, key: str,
                  max_model_len: int | None = None) -> tuple[Any, dict[str, Any]]:
    """The profiling scripts' engine for these batches and their result header (key: {})."""
    engine, _, _ = build_engine(level, max(batches), context, kv_blocks(max(batches), context),
                                max_model_len)
    return engine, {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "level": level, "max_model_len": engine.config.max_model_len, key: {}}


def capture(engine, mode, sizes: list[int]) -> tuple[Any, float]:
    from atom.cudagraph.runner import GraphRunner

    gr = GraphRunner(engine.config, mode=mode, capture_sizes=sizes)
    engine.runner.graph_runner = gr
    seconds, _ = engine.runner.capture_cudagraph()
    return gr, seconds


def fill_batch(engine, batch: int, context: int) -> None:
    """batch sequences of `context` prompt tokens, prefilled, decoding indefinitely."""
    from atom.engine.params import SamplingParams

    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    vocab = engine.hf_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(10, vocab, (context,), generator=g).tolist()
        engine.add_request(f"b{batch}-{i}", prompt, params)
    while True:  # run prefill chunks until a pure decode step is next
        engine.step()
        if all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running) \
                and not engine.scheduler.waiting:
            break


@contextmanager
def prepared_decode(engine) -> Iterator[tuple[Any, Any, Any]]:
    """(runner, input_ids, logits indices) of the next decode batch, prepared once with its
    forward context set; on exit the sequences are un-scheduled (the next step takes them)."""
    from atom.engine.batch import StepBatch

    runner = engine.runner
    engine.read_launched()  # the batch's tokens on the host: nothing pending on the device
    sched = engine.scheduler.schedule()
    assert not sched.is_prefill, "expected a pure decode batch"
    seqs = sched.seqs
    try:
        with torch.inference_mode():
            batch = StepBatch.of(seqs, False)
            step = runner.prepare_step(batch)  # padded to its plan, as execute_model's
            idx = runner.logits_rows(runner._logits_indices(batch))  # as execute_model
            with runner.prepared_context(step):
                yield runner, step.input_ids, idx
    finally:
        for s in seqs:
            s.num_scheduled_tokens = 0


def time_forward(engine, iters: int) -> float:
    """ms per run_model on the next decode batch (prepared once, replayed/run iters times)."""
    with prepared_decode(engine) as (runner, input_ids, idx):
        for _ in range(3):
            runner.run_model(input_ids, idx)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            runner.run_model(input_ids, idx)
        sync()
        return (time.perf_counter() - t0) / iters * 1e3


def time_steps(engine, steps: int, asynchronous: bool = True) -> tuple[float, float]:
    """ms per LLMEngine.step() over `steps` steps: (wall time from one synchronisation to the
    next, over steps; GPU time between events recorded on the stream after the first step and
    after the last, over steps - 1). The first holds the pipeline's fill once (the GPU idles
    while the host prepares the first step); the second is the steady state: every gap the
    GPU waits for the host between those steps is in it, the fill is not."""
    saved, engine.async_scheduling = engine.async_scheduling, asynchronous
    try:
        for _ in range(2):
            engine.step()
        sync()
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        engine.step()
        first.record()
        for _ in range(steps - 1):
            engine.step()
        last.record()
        sync()  # asynchronous: the last step has run, though not yet read
        wall_ms = (time.perf_counter() - t0) / steps * 1e3
        return wall_ms, first.elapsed_time(last) / (steps - 1)
    finally:
        engine.async_scheduling = saved


@contextmanager
def filled_batch(engine, batch: int, context: int) -> Iterator[None]:
    """`batch` sequences decoding (fill_batch) for the with-block, drained after; filling and
    draining run with no graph runner."""
    engine.runner.graph_runner = None
    fill_batch(engine, batch, context)
    try:
        yield
    finally:
        engine.runner.graph_runner = None
        drain(engine)


def drain(engine) -> None:
    for rid in list(engine._seqs):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def bench_level(level: int, batches: list[int], modes: list[str], context: int, iters: int,
                steps: int, ladder: bool) -> dict[str, Any]:
    from atom.config import CUDAGraphMode
    from atom.utils.counters import counters

    max_bs = max(batches)
    engine, init_s, summary = build_engine(level, max(512 if ladder else max_bs, max_bs),
                                           context, kv_blocks(max_bs, context))
    out: dict[str, Any] = {"init_seconds": round(init_s, 2),
                           "compile_seconds": summary.get("compile_seconds"),
                           "modes": {}, "capture": {}}
    runners: dict[str, Any] = {}
    for name in modes:
        mode = CUDAGraphMode.parse(name)
        if mode == CUDAGraphMode.NONE:
            runners[name] = None
            continue
        gr, secs = capture(engine, mode, sorted(set(batches)))
        runners[name] = gr
        out["capture"][name] = {"sizes": sorted(set(batches)), "seconds": round(secs, 3),
                                "pool_bytes": gr.pool_bytes}
    for batch in batches:
        with filled_batch(engine, batch, context):
            for name in modes:
                engine.runner.graph_runner = runners[name]
                with counters.track() as d:
                    fwd = time_forward(engine, iters)
                    stp, steady = time_steps(engine, steps)
                    stp_sync, _ = time_steps(engine, steps, asynchronous=False)
                replays = d.get("graph_replays", 0)
                if name != "NONE":
                    assert replays > 0, f"{name} at batch {batch} did not replay: {d}"
                out["modes"].setdefault(name, {})[str(batch)] = {
                    "forward_ms": round(fwd, 4), "step_ms": round(stp, 4),
                    "steady_step_ms": round(steady, 4), "step_sync_ms": round(stp_sync, 4),
                    "replays": replays}
                print(f"level {level} {name:>10} batch {batch:>3}: forward {fwd:7.3f} ms, "
                      f"step {stp:7.3f} ms (steady {steady:7.3f}, synchronous "
                      f"{stp_sync:7.3f})", flush=True)
    if ladder:
        for name in [m for m in modes if m != "NONE"]:
            engine.runner.graph_runner = None
            runners.pop(name, None)
            gc.collect()
            gr, secs = capture(engine, CUDAGraphMode.parse(name), DEFAULT_LADDER)
            out["capture"][f"{name}_default_ladder"] = {
                "sizes": len(DEFAULT_LADDER), "seconds": round(secs, 2),
                "pool_bytes": gr.pool_bytes}
            print(f"level {level} {name}: default ladder ({len(DEFAULT_LADDER)} sizes) captured "
                  f"in {secs:.2f} s, pool {gr.pool_bytes / 2**20:.0f} MiB", flush=True)
            del gr
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    out["weight_bytes"] = int(weights)
    hf = engine.hf_config
    out["kv_bytes_per_token"] = int(2 * hf.num_hidden_layers * hf.num_key_value_heads
                                    * hf.head_dim * 2)
    engine.runner.graph_runner = None
    del engine, runners
    gc.collect()
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- transformers


def transformers_model() -> Any:
    """transformers' LlamaForCausalLM on the engine model's shape, bf16 random weights on the
    GPU, never stopping at an end-of-sequence token."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    from atom.models.registry import load_model_config

    shape = load_model_config(MODEL)
    cfg = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        rms_norm_eps=shape.rms_norm_eps, max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=shape.tie_word_embeddings,
    )  # RoPE parameters left at defaults: they do not change the step's cost
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = HFLlama(cfg).eval()
    finally:
        torch.set_default_dtype(prev)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    return model


def transformers_generate(model: Any, ids: torch.Tensor, new_tokens: int, cache_tokens: int
                          ) -> float:
    """Seconds for generate() of `new_tokens` greedy tokens with a static cache sized for
    `cache_tokens` new ones (one size for every call, so nothing recompiles)."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stop_len = ids.shape[1] + new_tokens

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> Any:
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= stop_len,
                              dtype=torch.bool, device=input_ids.device)

    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=cache_tokens,
                       do_sample=False, cache_implementation="static", pad_token_id=0,
                       stopping_criteria=StoppingCriteriaList([StopAfter()]))
    sync()
    return time.perf_counter() - t0


def transformers_warm_prompt(model: Any, batch: int, context: int, n1: int
                             ) -> tuple[torch.Tensor, float]:
    """(random prompt ids of batch x context, seconds of two generate() calls of n1 new tokens
    on them: the first compiles the forward, the second runs warm)."""
    ids = torch.randint(10, 120_000, (batch, context), device="cuda")
    t0 = time.perf_counter()
    for _ in range(2):
        transformers_generate(model, ids, n1, n1)
    return ids, time.perf_counter() - t0


def transformers_pair_ms(model: Any, ids: torch.Tensor, n0: int, n1: int) -> float:
    """ms per decode step from one pair: (time of n1 new tokens - time of n0) / (n1 - n0)."""
    t_small = transformers_generate(model, ids, n0, n1)
    t_big = transformers_generate(model, ids, n1, n1)
    return (t_big - t_small) / (n1 - n0) * 1e3


def bench_transformers(batches: list[int], context: int, n0: int, n1: int,
                       repeats: int = 5) -> dict[str, Any]:
    """ms per decode step of generate() with a static cache (auto torch.compile): the median
    over `repeats` of (time of n1 new tokens - time of n0) / (n1 - n0); one pair alone moved
    by up to 60% between runs (docs/performance.md)."""
    model = transformers_model()
    out: dict[str, Any] = {}
    for batch in batches:
        ids, warm = transformers_warm_prompt(model, batch, context, n1)
        samples = [transformers_pair_ms(model, ids, n0, n1) for _ in range(repeats)]
        ms = statistics.median(samples)
        out[str(batch)] = {"decode_ms": round(ms, 4), "samples_ms": [round(x, 4) for x in samples],
                           "warmup_seconds": round(warm, 1)}
        print(f"transformers static+compile batch {batch:>3}: {ms:7.3f} ms/step, median of "
              f"{repeats} (min {min(samples):.3f}, max {max(samples):.3f}; warm-up {warm:.1f} s)",
              flush=True)
    model.cpu()
    gc.collect()
    torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- report


def table(result: dict[str, Any]) -> str:
    batches = result["batches"]
    lines = ["| what | " + " | ".join(f"batch {b}" for b in batches) + " |",
             "|---|" + "---|" * len(batches)]
    lines.append("| bound (weights + KV) / copy rate | "
                 + " | ".join(f"{result['bound_ms'][str(b)]:.3f}" for b in batches) + " |")
    for level, data in result["levels"].items():
        for mode, per in data["modes"].items():
            for key, what in (("forward_ms", "forward"), ("step_ms", "engine step"),
                              ("steady_step_ms", "engine step, steady state"),
                              ("step_sync_ms", "engine step, synchronous")):
                lines.append(f"| level {level} {mode} {what} | "
                             + " | ".join(f"{per[str(b)][key]:.3f}" for b in batches) + " |")
    if result.get("transformers"):
        hf = result["transformers"]
        lines.append("| transformers static cache + compile | "
                     + " | ".join(f"{hf[str(b)]['decode_ms']:.3f}" if str(b) in hf else "-"
                                  for b in batches) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--levels", type=int, nargs="*", default=[0, 3])
    ap.add_argument("--modes", nargs="+", default=["NONE", "TR_HYBRID", "FULL"])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-ladder", action="store_true", help="skip the default-ladder capture")
    ap.add_argument("--ladder-levels", type=int, nargs="+", default=[3])
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--hf-batches", type=int, nargs="+", default=None)
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    commit = args.commit or git_commit()
    rate = copy_rate_bytes_per_s()
    print(f"device copy rate {rate / 1e12:.2f} TB/s", flush=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "python": platform.python_version(), "model": MODEL, "dtype": "bfloat16",
        "context": args.context, "batches": args.batches, "copy_rate_Bps": rate, "levels": {},
    }
    for level in args.levels:
        result["levels"][str(level)] = bench_level(
            level, args.batches, args.modes, args.context, args.iters, args.steps,
            ladder=not args.no_ladder and level in args.ladder_levels)
        with open(args.out, "w") as f:  # partial results survive a later failure
            json.dump(result, f, indent=2)
    weight_bytes, kv_per_token = shape_bytes(args.context)
    for level, data in result["levels"].items():  # the engine's own count should agree
        if data["weight_bytes"] != weight_bytes:
            print(f"note: level {level} engine holds {data['weight_bytes']} weight bytes, "
                  f"the shape counts {weight_bytes}", flush=True)
    result["weight_bytes"], result["kv_bytes_per_token"] = weight_bytes, kv_per_token
    result["bound_ms"] = {
        str(b): round(bound_ms(weight_bytes, kv_per_token, b, args.context, rate), 4)
        for b in args.batches}
    if not args.no_transformers:
        try:
            result["transformers"] = bench_transformers(args.hf_batches or args.batches,
                                                        args.context, 16, 80)
        except Exception as exc:  # noqa: BLE001 - record, keep the engine figures
            result["transformers_error"] = repr(exc)
            print(f"transformers benchmark failed: {exc!r}", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))


if __name__ == "__main__":
    main()
