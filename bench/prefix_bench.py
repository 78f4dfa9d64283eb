"""Prefix-caching benchmark: the same workload against a server with caching on, then one with
it off (`--no-enable-prefix-caching`), started one after the other by this script.

Phases, per server:
1. zero-hit decode: every client sends one request with its own random prompt (no prefix is
   shared, so the hit rate is 0%): inter-token latency with caching on vs off shows what the
   bookkeeping costs a decode step.
2. multi-turn chat: `--clients` clients each send `--turns` turns. Every prompt starts with one
   shared `--system-len`-token system prompt, followed by the client's own history: each turn
   appends its user message (`--user-len` tokens) to the previous prompt and the previous
   reply, so turn t's prompt extends turn t-1's. The reply enters the history as fixed token
   ids (the dummy weights' replies are noise; what matters is that each prompt extends the
   last). TTFT p50/p99 and throughput (output and prompt tokens per second).
3. repeated prompt: `--repeat-prompts` distinct `--repeat-len`-token prompts, each sent twice
   in a row: the median TTFT of the second requests (served from the cache) against the
   median of the first. A pair on another prompt of that length goes first, so the first
   requests' TTFT holds no one-time cost of the length (nor the repeats' of theirs).
The server's /status prefix-cache counters are read after each phase (hit rate per phase).

    # H200 (defaults: llama-3.2-1b, dummy weights, level 3, TR_HYBRID, 64 clients x 8 turns)
    python bench/prefix_bench.py --out bench/results/prefix-h200.json
    # CPU smoke run (tiny-llama, level 0, a few small clients)
    python bench/prefix_bench.py --quick --out /tmp/prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from serve_bench import (
    RequestResult,
    git_commit,
    one_request,
    percentile,
    result_counts,
)
from serve_bench import start_server as start_bench_server

QUICK = {
    "model": "tiny-llama",
    "dtype": "float32",
    "level": 0,
    "cudagraph_mode": "NONE",
    "clients": 4,
    "turns": 3,
    "system_len": 256,
    "user_len": 32,
    "max_tokens": 8,
    "repeat_len": 512,
    "repeat_prompts": 3,
    "zero_hit_len": 64,
    "zero_hit_tokens": 16,
}


def _ms(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 3) if values else 0.0,
        "p99": round(percentile(values, 99), 3),
    }


def _summary(results: list[RequestResult], wall: float, prompt_tokens: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    return {
        **result_counts(results, wall),
        "prompt_tokens": prompt_tokens,
        "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "prompt_throughput_tok_s": round(prompt_tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_ms": _ms([r.ttft_s * 1000 for r in ok]),
        "itl_ms": _ms([x * 1000 for r in ok for x in r.itl_s]),
    }


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 250) for _ in range(n)]  # valid in any vocabulary >= 256


def _client(clients: int) -> Any:
    """serve_bench.one_request's aiohttp session."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=clients + 4)
    return aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None))


async def _request(
    c: Any, url: str, model: str, prompt: list[int], max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 1,
        "temperature": 0.0,
    }
    return await one_request(c, url, body)


async def zero_hit(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [_ids(rng, args.zero_hit_len) for _ in range(args.clients)]
    async with _client(args.clients) as c:
        t0 = time.perf_counter()
        results = await asyncio.gather(
            *(_request(c, url, model, p, args.zero_hit_tokens) for p in prompts)
        )
        wall = time.perf_counter() - t0
    return _summary(list(results), wall, sum(map(len, prompts)))


async def multi_turn(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    system = _ids(rng, args.system_len)
    per_turn: list[list[RequestResult]] = [[] for _ in range(args.turns)]
    prompt_tokens = 0

    async with _client(args.clients) as c:

        async def chat(i: int) -> None:
            nonlocal prompt_tokens
            own = random.Random(seed * 1000 + i)
            prompt = list(system)
            for turn in range(args.turns):
                prompt += _ids(own, args.user_len)
                prompt_tokens += len(prompt)
                per_turn[turn].append(await _request(c, url, model, prompt, args.max_tokens))
                prompt += _ids(own, args.max_tokens)  # the reply, as history

        t0 = time.perf_counter()
        await asyncio.gather(*(chat(i) for i in range(args.clients)))
        wall = time.perf_counter() - t0
    out = _summary([r for turn in per_turn for r in turn], wall, prompt_tokens)
    out["ttft_ms_by_turn"] = [_ms([r.ttft_s * 1000 for r in t if r.ok])["median"] for t in per_turn]
    return out


async def repeated(url: str, model: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    pairs: list[tuple[RequestResult, RequestResult]] = []
    async with _client(1) as c:
        warm = _ids(rng, args.repeat_len)  # the length's first-call costs, on a prompt of its own
        for _ in range(2):
            await _request(c, url, model, warm, 1)
        for _ in range(args.repeat_prompts):
            prompt = _ids(rng, args.repeat_len)
            first = await _request(c, url, model, prompt, 1)
            pairs.append((first, await _request(c, url, model, prompt, 1)))
    firsts = [f.ttft_s * 1000 for f, _ in pairs]
    seconds = [s.ttft_s * 1000 for _, s in pairs]
    a, b = statistics.median(firsts), statistics.median(seconds)
    return {
        "prompt_len": args.repeat_len,
        "prompts": len(pairs),
        "ok": all(f.ok and s.ok for f, s in pairs),
        "first_ttft_ms": round(a, 3),
        "second_ttft_ms": round(b, 3),
        "speedup": round(a / b, 2) if b > 0 else 0.0,
        "first_ttft_ms_each": [round(x, 3) for x in firsts],
        "second_ttft_ms_each": [round(x, 3) for x in seconds],
    }


def prefix_status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/status", timeout=10).json().get("prefix_cache", {})


def run_server(args: argparse.Namespace, caching: bool) -> dict[str, Any]:
    extra = [f"--max-model-len={args.max_model_len}"]
    if args.cudagraph_mode:
        extra.append(f"--cudagraph-mode={args.cudagraph_mode}")
    if args.num_kv_blocks:
        extra.append(f"--num-kv-blocks={args.num_kv_blocks}")
    if not caching:
        extra.append("--no-enable-prefix-caching")
    ns = argparse.Namespace(
        port=args.port,
        server_log=f"{args.server_log}.{'on' if caching else 'off'}",
        start_timeout=args.start_timeout,
    )
    server_args = [
        f"--model={args.model}",
        f"--load-format={args.load_format}",
        f"--dtype={args.dtype}",
        f"--max-num-seqs={args.clients * 2}",
        *([f"--level={args.level}"] if args.level is not None else []),
        *extra,
        *args.server_arg,
    ]
    proc, url = start_bench_server(ns, server_args)
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        status = httpx.get(url + "/status", timeout=10).json()
        # Warm-up on prompts no phase uses (first-call costs, not cache effects).
        asyncio.run(
            repeated(url, model, argparse.Namespace(repeat_len=32, repeat_prompts=1), args.seed + 7)
        )
        phases: dict[str, Any] = {}
        for name, phase, seed in (
            ("zero_hit", zero_hit, args.seed + 1),
            ("multi_turn", multi_turn, args.seed + 2),
            ("repeated", repeated, args.seed + 3),
        ):
            before = prefix_status(url)
            result = asyncio.run(phase(url, model, args, seed))
            after = prefix_status(url)
            q = after.get("queried_tokens", 0) - before.get("queried_tokens", 0)
            h = after.get("hit_tokens", 0) - before.get("hit_tokens", 0)
            result["prefix_cache"] = {
                "queried_tokens": q,
                "hit_tokens": h,
                "hit_rate": round(h / q, 4) if q else 0.0,
            }
            phases[name] = result
            print(
                f"  caching {'on' if caching else 'off'}: {name}: {json.dumps(result)}", flush=True
            )
            if name == "repeated":
                print(
                    f"  caching {'on' if caching else 'off'}: repeated {args.repeat_len}-token "
                    f"prompts, median of {result['prompts']}: first {result['first_ttft_ms']} ms, "
                    f"repeat {result['second_ttft_ms']} ms, ratio {result['speedup']}x",
                    flush=True,
                )
        keys = ("level", "mode", "effective_mode", "device", "dtype", "enable_prefix_caching")
        return {"server_status": {k: status.get(k) for k in keys}, **phases}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def compare(on: dict[str, Any], off: dict[str, Any]) -> dict[str, Any]:
    def ratio(a: float, b: float) -> float:
        return round(a / b, 3) if b else 0.0

    mt_on, mt_off = on["multi_turn"], off["multi_turn"]
    return {
        "multi_turn_throughput_x": ratio(mt_on["throughput_tok_s"], mt_off["throughput_tok_s"]),
        "multi_turn_ttft_p50_x": ratio(mt_off["ttft_ms"]["median"], mt_on["ttft_ms"]["median"]),
        "multi_turn_ttft_p99_x": ratio(mt_off["ttft_ms"]["p99"], mt_on["ttft_ms"]["p99"]),
        "repeated_ttft_x": on["repeated"]["speedup"],
        "zero_hit_itl_p50_on_over_off": ratio(
            on["zero_hit"]["itl_ms"]["median"], off["zero_hit"]["itl_ms"]["median"]
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="CPU smoke run: " + json.dumps(QUICK))
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--level", type=int, default=3)
    p.add_argument("--cudagraph-mode", default="TR_HYBRID")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="CPU only (GPU: from memory)")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--server-arg", action="append", default=[], help="extra serve flag (repeat)")
    p.add_argument("--server-log", default="/tmp/atom-prefix-bench-server.log")
    p.add_argument("--start-timeout", type=float, default=1800.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=2048, help="shared system prompt tokens")
    p.add_argument("--user-len", type=int, default=64, help="user message tokens per turn")
    p.add_argument("--max-tokens", type=int, default=64, help="reply tokens per turn")
    p.add_argument("--repeat-len", type=int, default=4096, help="the repeated prompts' tokens")
    p.add_argument(
        "--repeat-prompts", type=int, default=8, help="distinct prompts of the repeated phase"
    )
    p.add_argument("--zero-hit-len", type=int, default=128, help="zero-hit phase prompt tokens")
    p.add_argument("--zero-hit-tokens", type=int, default=128, help="zero-hit phase output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--servers",
        nargs="+",
        choices=("on", "off"),
        default=["on", "off"],
        help="which servers to run (one alone: its phases, no comparison)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    longest_chat = args.system_len + args.turns * (args.user_len + args.max_tokens)
    args.max_model_len = (
        max(longest_chat, args.repeat_len + 1, args.zero_hit_len + args.zero_hit_tokens) + 16
    )
    if args.quick and args.num_kv_blocks is None:
        args.num_kv_blocks = 4 * ((args.max_model_len + 15) // 16)

    runs = {}
    for name in args.servers:
        print(f"server with prefix caching {name}", flush=True)
        runs[name] = run_server(args, name == "on")
    report = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git_commit(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "host": platform.node(),
        "workload": {
            k: getattr(args, k)
            for k in (
                "model",
                "dtype",
                "level",
                "cudagraph_mode",
                "clients",
                "turns",
                "system_len",
                "user_len",
                "max_tokens",
                "repeat_len",
                "repeat_prompts",
                "zero_hit_len",
                "zero_hit_tokens",
                "max_model_len",
                "num_kv_blocks",
            )
        },
        **{f"caching_{name}": run for name, run in runs.items()},
    }
    if len(runs) == 2:
        report["comparison"] = compare(runs["on"], runs["off"])
    print(
        json.dumps(
            report.get("comparison", {name: run["repeated"] for name, run in runs.items()}),
            indent=2,
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    failed = sum(r[ph]["failed"] for r in runs.values() for ph in ("zero_hit", "multi_turn"))
    return 0 if failed == 0 and all(r["repeated"]["ok"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
