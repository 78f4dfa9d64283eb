"""The peers' 8B workloads on one GPU, beside their published figures (issue 47).

Three parts, each selectable with --parts (one engine process each, one after the other, so
only one holds the GPU at a time):
- offline: `LLMEngine.generate()` at 128/128, 1000/1000 and 2048/2048 (prompt/output tokens,
  ignore_eos), each at the largest batch the KV cache holds (capped by --max-num-seqs),
  --offline-waves batches of it: output tok/s;
- decode: the batch-1 decode step (steady state, --decode-context tokens of context) against
  the HBM roofline: bytes a step reads (the weights it multiplies by, plus the sequence's KV)
  over the measured device copy rate;
- served: `atom-runtime serve`, closed-loop streaming clients at 1, 16, 32, 64, 256 and the
  saturation concurrency (--saturation-clients) on --served-len (default 1000/1000): output
  tok/s, TTFT p50/p99 over all requests and over each client's second and later requests (the
  first wave's burst left out), ITL p50/p99 (bench/serve_bench.py's clients).

The report names the card and the precision of every row, ours and the peers'.

    # one H100/H200, bf16, then FP8 weights and KV cache
    PYTHONPATH=runtime:operator python3 bench/peer_bench.py --out bench/results/peer/bf16.json
    PYTHONPATH=runtime:operator python3 bench/peer_bench.py --quantization fp8 \
        --kv-cache-dtype fp8 --parts offline decode --out bench/results/peer/fp8.json
    # CPU smoke run (tiny-llama, float32, level 0, tiny counts)
    python3 bench/peer_bench.py --quick --out /tmp/peer-quick.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import REPO, free_port, git_commit
from serve_bench import Scenario, prompts_for, run_served, start_server, stop_server


@dataclass(frozen=True)
class PeerFigure:
    """One published figure (never rerun here)."""

    system: str
    card: str
    precision: str
    workload: str  # "offline 1000/1000", "served saturation", "decode batch 1", ...
    metric: str
    value: float
    source: str


TRT = "NVIDIA/TensorRT-LLM:docs/source/performance/perf-overview.md"
RUNINFRA = "runinfra.ai benchmark, June 2026"
PEERS = [
    *(PeerFigure("TensorRT-LLM 1.0", card, "FP8", f"offline {w}", "output tok/s", v, TRT)
      for card, figures in (("H100", (28312, 15220, 9305)), ("H200", (27911, 17744, 12194)))
      for w, v in zip(("128/128", "1000/1000", "2048/2048"), figures, strict=True)),
    PeerFigure("vLLM 0.23", "H100", "not stated", "served saturation", "output tok/s", 5333,
               RUNINFRA),
    PeerFigure("vLLM 0.23", "H100", "not stated", "served 32 clients", "TTFT ms", 514, RUNINFRA),
    PeerFigure("TensorRT-LLM", "H100", "not stated", "served 32 clients", "TTFT ms", 235,
               RUNINFRA),
    PeerFigure("vLLM (MLPerf 5.1)", "H100", "FP8", "offline (MLPerf)", "output tok/s", 5777,
               "MLPerf Inference 5.1"),
    PeerFigure("vLLM (MLPerf 5.1)", "H100", "FP8", "served (MLPerf server)", "output tok/s",
               5103, "MLPerf Inference 5.1"),
    PeerFigure("vLLM 0.21", "H100", "FP16", "decode batch 1", "step ms", 6.48,
               "yobitelcomm bench, May 2026 (about 75% of the bandwidth roofline)"),
]
OFFLINE_WORKLOADS = ((128, 128), (1000, 1000), (2048, 2048))
SERVED_CLIENTS = (1, 16, 32, 64, 256)


# ---- the engine process (offline and decode parts) -----------------------------------------------
def largest_batch(num_blocks: int, block_size: int, prompt_len: int, output_len: int,
                  max_num_seqs: int) -> int:
    """Sequences of prompt_len + output_len tokens the KV cache holds at once (each its own
    blocks, no prefix shared), capped by the scheduler's max_num_seqs; at least 1."""
    per_seq = -(-(prompt_len + output_len) // block_size)
    return max(1, min(max_num_seqs, num_blocks // per_seq))


def bytes_per_step(model: Any, kv_bytes_per_token: int, context: int) -> int:
    """Bytes one batch-1 decode step must read: every weight it multiplies by (an untied
    embedding table is only indexed, one row a step: left out) and the sequence's KV."""
    skip = set()
    if not model.tie_word_embeddings:
        skip.add(model.model.embed_tokens.weight.data_ptr())
    weights = sum(p.numel() * p.element_size() for p in model.parameters()
                  if p.data_ptr() not in skip)
    # --quantization fp8: the projections' FP8 weights and scales are buffers.
    from atom.quantization.fp8_layers import Fp8Weights

    fp8 = sum(t.numel() * t.element_size() for m in model.modules()
              if isinstance(m, Fp8Weights) for t in m.buffers())
    return weights + fp8 + kv_bytes_per_token * context


def copy_rate(device: str) -> float:
    """Device copy rate, bytes read and written per second (common's on CUDA)."""
    if device == "cuda":
        from common import copy_rate_bytes_per_s

        return copy_rate_bytes_per_s()
    import torch

    src = torch.empty(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(4):
        dst.copy_(src)
    return 2 * src.numel() * 4 / (time.perf_counter() - t0)


def decode_step_ms(engine: Any, device: str, steps: int) -> float:
    """Steady-state ms per engine step of the batch now decoding: GPU time between events on
    CUDA (decode_bench.time_steps), wall time of synchronous steps on the CPU."""
    if device == "cuda":
        from decode_bench import time_steps

        return time_steps(engine, steps)[1]
    engine.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def engine_worker(spec_json: str) -> None:
    """In a subprocess: the offline workloads and the batch-1 decode roofline; one JSON line."""
    spec = json.loads(spec_json)
    import torch

    from atom.cli.args import build_parser
    from atom.cli.config import config_from_args
    from atom.engine import LLMEngine, SamplingParams
    from decode_bench import drain, fill_batch

    config = config_from_args(build_parser().parse_args(["serve", *spec["engine_args"]]))
    engine = LLMEngine(config)
    engine.warmup()
    device = str(config.device)
    blocks, block_size = engine.block_manager.num_blocks, config.block_size
    out: dict[str, Any] = {"kv_blocks": blocks, "block_size": block_size, "offline": []}
    if "offline" in spec["parts"]:
        for prompt_len, output_len in spec["workloads"]:
            batch = largest_batch(blocks, block_size, prompt_len, output_len,
                                  int(config.max_num_seqs))
            sc = Scenario(batch, prompt_len, output_len, spec["waves"])
            prompts = prompts_for(sc, spec["seed"])
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            engine.generate(prompts[: min(batch, 8)],
                            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            t0 = time.perf_counter()
            tokens = sum(len(t) for t in engine.generate(prompts, params))
            wall = time.perf_counter() - t0
            out["offline"].append({"workload": f"{prompt_len}/{output_len}", "batch": batch,
                                   "prompts": len(prompts), "tokens": tokens,
                                   "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1)})
            print(f"offline {prompt_len}/{output_len} at batch {batch}: "
                  f"{out['offline'][-1]['tok_s']} tok/s", file=sys.stderr, flush=True)
    if "decode" in spec["parts"]:
        context = spec["decode_context"]
        runner = engine.runner
        kv = runner.kv_cache  # [2, layers, blocks, block_size, kv_heads, head_dim]
        kv_per_token = kv[:, :, 0, 0].numel() * kv.element_size()
        fill_batch(engine, 1, context)
        try:
            step_ms = decode_step_ms(engine, device, spec["decode_steps"])
        finally:
            drain(engine)
        rate = copy_rate(device)
        read = bytes_per_step(runner.model, kv_per_token, context)
        bound = read / rate * 1e3
        out["decode"] = {"context": context, "step_ms": round(step_ms, 4),
                         "bytes_per_step": read, "copy_rate_GBps": round(rate / 1e9, 1),
                         "roofline_ms": round(bound, 4),
                         "step_over_roofline": round(step_ms / bound, 3)}
    out["card"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print("ENGINE " + json.dumps(out), flush=True)


def run_engine_worker(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--engine-worker", json.dumps(spec)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    for line in done.stdout.splitlines():
        if line.startswith("ENGINE "):
            return dict(json.loads(line[len("ENGINE "):]))
    raise SystemExit(f"engine worker failed ({done.returncode}):\n{done.stderr[-4000:]}")


# ---- the report ---------------------------------------------------------------------------------
def precision(args: argparse.Namespace) -> str:
    weights = "FP8" if args.quantization == "fp8" else args.dtype.replace("bfloat16", "BF16")
    kv = "FP8 KV" if args.kv_cache_dtype == "fp8" else f"{weights} KV"
    return f"{weights} weights, {kv}"


def comparison(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Our rows beside the peers' published figures for the same workload."""
    rows: list[dict[str, Any]] = []
    ours = {"card": report["card"], "precision": report["precision"]}
    for r in report.get("offline", []):
        rows.append({**ours, "workload": f"offline {r['workload']}", "metric": "output tok/s",
                     "value": r["tok_s"], "note": f"batch {r['batch']}"})
    for r in report.get("served", []):
        name = "served saturation" if r["saturation"] else f"served {r['clients']} clients"
        rows.append({**ours, "workload": name, "metric": "output tok/s", "value": r["tok_s"],
                     "note": f"{r['workload']}"})
        ttft, later, itl = r["ttft_ms"], r["ttft_later_ms"], r["itl_ms"]
        rows.append({**ours, "workload": name, "metric": "TTFT ms", "value": ttft["p50"],
                     "note": f"p50; p99 {ttft['p99']}; later requests p50 {later['p50']} "
                             f"p99 {later['p99']}"})
        rows.append({**ours, "workload": name, "metric": "ITL ms", "value": itl["p50"],
                     "note": f"p50; p99 {itl['p99']}"})
    if "decode" in report:
        d = report["decode"]
        rows.append({**ours, "workload": "decode batch 1", "metric": "step ms",
                     "value": d["step_ms"],
                     "note": f"{d['step_over_roofline']}x roofline {d['roofline_ms']} ms"})
    out = []
    for row in rows:
        out.append({**row, "system": "ours"})
        for p in PEERS:
            if p.workload == row["workload"] and p.metric == row["metric"]:
                out.append({**asdict(p), "system": p.system, "note": p.source})
    return out


def targets(report: dict[str, Any]) -> list[str]:
    """Issue 47's targets that this report's rows decide, each 'PASS: ...' or 'FAIL: ...'."""
    lines: list[str] = []

    def add(ok: bool, text: str) -> None:
        lines.append(("PASS: " if ok else "FAIL: ") + text)

    card = "H200" if "H200" in report["card"] else "H100"
    fp8 = report["precision"].startswith("FP8")
    if "decode" in report and not fp8:
        r = report["decode"]["step_over_roofline"]
        add(r <= 1.2, f"batch-1 decode step {r:.2f}x the HBM roofline <= 1.2x")
    offline = {r["workload"]: r["tok_s"] for r in report.get("offline", [])}
    served = {r["clients"]: r for r in report.get("served", [])}
    sat = next((r for r in served.values() if r["saturation"]), None)
    if sat is not None and sat["workload"] == "1000/1000" and not fp8:
        add(sat["tok_s"] >= 1.5 * 5333,
            f"served at saturation {sat['tok_s']:.0f} tok/s >= 1.5x vLLM's 5,333 (H100)")
        if "1000/1000" in offline:
            add(sat["tok_s"] >= 0.9 * offline["1000/1000"],
                f"served at saturation {sat['tok_s']:.0f} >= 0.9x offline "
                f"{offline['1000/1000']:.0f} tok/s")
    if fp8 and "1000/1000" in offline:
        trt = next(p.value for p in PEERS if p.system == "TensorRT-LLM 1.0" and p.card == card
                   and p.workload == "offline 1000/1000")
        add(offline["1000/1000"] >= 0.8 * trt,
            f"FP8 offline 1000/1000 {offline['1000/1000']:.0f} tok/s >= 0.8x TensorRT-LLM's "
            f"{trt:,.0f} ({card})")
    if 64 in served and served[64]["workload"].startswith("1000/"):
        p99 = served[64]["ttft_later_ms"]["p99"]
        add(p99 <= 300, f"TTFT p99 at 64 clients (second and later requests) {p99:.0f} ms "
                        "<= 300 ms")
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'workload':<26} {'metric':<13} {'system':<20} {'card':<24} {'precision':<28} "
            f"{'value':>10}  note")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['workload']:<26} {r['metric']:<13} {r['system']:<20} {r['card'][:24]:<24} "
              f"{r['precision'][:28]:<28} {r['value']:>10,.2f}  {r['note']}")


# ---- the run ------------------------------------------------------------------------------------
def engine_args(args: argparse.Namespace, max_len: int) -> list[str]:
    return [
        "--model", args.model, "--load-format", args.load_format, "--dtype", args.dtype,
        "--level", str(args.level), "--max-num-seqs", str(args.max_num_seqs),
        "--max-model-len", str(max_len),
        *(["--cudagraph-mode", args.cudagraph_mode] if args.cudagraph_mode else []),
        *(["--quantization", args.quantization] if args.quantization != "none" else []),
        *(["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else []),
        *(["--device", args.device] if args.device else []),
        *args.server_arg,
    ]


def served_rows(args: argparse.Namespace, serve_args: list[str]) -> list[dict[str, Any]]:
    prompt_len, output_len = args.served_len
    proc, url = start_server(args, [*serve_args, "--max-waiting", "8192"])
    rows = []
    try:
        model = ((_models(url) or {"data": [{"id": args.model}]})["data"][0]["id"])
        logprobs = not args.no_logprobs
        run_served(url, model, Scenario(4, prompt_len, 8, 1), args.seed + 1, 1, logprobs)
        for clients in [*args.clients, args.saturation_clients]:
            sc = Scenario(clients, prompt_len, output_len, args.requests_per_client)
            r = run_served(url, model, sc, args.seed, args.client_procs, logprobs)
            rows.append({"clients": clients, "saturation": clients == args.saturation_clients,
                         "workload": f"{prompt_len}/{output_len}", **r})
            print(f"served {sc.name}: {r['tok_s']} tok/s, TTFT p99 later "
                  f"{r['ttft_later_ms']['p99']} ms, {r['failed']} failed", flush=True)
    finally:
        stop_server(proc)
    return rows


def _models(url: str) -> dict[str, Any] | None:
    from serve_bench import _get

    return _get(url + "/v1/models")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none")
    p.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--cudagraph-mode", default=None, help="default: the engine's")
    p.add_argument("--device", default=None)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--parts", nargs="+", choices=("offline", "decode", "served"),
                   default=["offline", "decode", "served"])
    p.add_argument("--workloads", nargs="+", default=[f"{i}/{o}" for i, o in OFFLINE_WORKLOADS],
                   help="offline prompt/output lengths")
    p.add_argument("--offline-waves", type=int, default=2, help="prompts = waves x batch")
    p.add_argument("--decode-context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=200)
    p.add_argument("--served-len", default="1000/1000", help="served prompt/output lengths")
    p.add_argument("--clients", type=int, nargs="+", default=list(SERVED_CLIENTS))
    p.add_argument("--saturation-clients", type=int, default=512)
    p.add_argument("--requests-per-client", type=int, default=2,
                   help=">= 2: TTFT over each client's later requests needs a second")
    p.add_argument("--client-procs", type=int, default=4)
    p.add_argument("--no-logprobs", action="store_true",
                   help="served requests without logprobs: a streamed chunk then counts as one "
                        "token (serve_bench asks for them so every token is counted)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra engine flag (repeat), e.g. --server-arg=--max-num-batched-tokens=4096")
    p.add_argument("--quick", action="store_true",
                   help="CPU smoke run: tiny-llama, float32, level 0, tiny counts")
    p.add_argument("--port", type=int, default=8124, help="0: a free port")
    p.add_argument("--server-log", default="/tmp/atom-peer-bench-server.log")
    p.add_argument("--start-timeout", type=float, default=1800.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--engine-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.dtype, args.level, args.device = "tiny-llama", "float32", 0, "cpu"
        args.workloads, args.served_len, args.max_num_seqs = ["16/8"], "16/8", 16
        args.clients, args.saturation_clients, args.client_procs = [1], 4, 1
        args.decode_context, args.decode_steps, args.offline_waves = 32, 10, 1
        args.server_arg = [*args.server_arg, "--num-kv-blocks", "64"]
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # see serve_bench --quick
    if args.port == 0:
        args.port = free_port()
    args.workloads = [tuple(int(n) for n in w.split("/")) for w in args.workloads]
    args.served_len = tuple(int(n) for n in args.served_len.split("/"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_worker:
        engine_worker(args.engine_worker)
        return 0
    lengths = [i + o for i, o in args.workloads] + [sum(args.served_len), args.decode_context + 64]
    eargs = engine_args(args, max(lengths) + 16)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": git_commit(short=True),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "model": args.model, "precision": precision(args), "engine_args": eargs,
    }
    if {"offline", "decode"} & set(args.parts):
        worker = run_engine_worker({
            "engine_args": eargs, "parts": args.parts, "workloads": args.workloads,
            "waves": args.offline_waves, "seed": args.seed,
            "decode_context": args.decode_context, "decode_steps": args.decode_steps})
        report["card"] = worker.pop("card")
        report.update(worker)
    if "served" in args.parts:
        report["served"] = served_rows(args, eargs)
    if "card" not in report:
        report["card"] = _card(args)
    report["comparison"] = comparison(report)
    report["targets"] = targets(report)
    print(f"\nmodel={args.model} card={report['card']} precision={report['precision']}")
    print_table(report["comparison"])
    for line in report["targets"]:
        print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r["failed"] == 0 for r in report.get("served", [])) else 1


def _card(args: argparse.Namespace) -> str:
    """The card, named without holding it (nvidia-smi), when no engine part ran."""
    if args.device == "cpu":
        return "cpu"
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)
    return done.stdout.splitlines()[0].strip() if done.stdout.strip() else "unknown"


if __name__ == "__main__":
    sys.exit(main())
