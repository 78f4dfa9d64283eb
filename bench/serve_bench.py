"""Serving benchmark: N concurrent streaming clients against an ATOM server.

For each concurrency level, every client sends `--requests-per-client` streaming completions back
to back (fixed prompt length in tokens, fixed output length with ignore_eos), and the benchmark
reports output throughput (tokens/s over the level's wall time), time to first token and
inter-token latency (median and p99). Each token's arrival is timed separately: requests ask for
logprobs, so the server sends every token in its own chunk even when it decodes to no text yet.

    # against a running server
    python bench/serve_bench.py --url http://127.0.0.1:8000 --clients 1 8 64 --out results.json
    # or start one (GPU: the Llama-3.2-1B shape with random weights)
    python bench/serve_bench.py --model llama-3.2-1b --level 3 --clients 1 8 64 --out results.json
    # CPU smoke check
    python bench/serve_bench.py --model tiny-llama --level 0 --dtype float32 --clients 1 8 \
        --requests-per-client 2 --max-tokens 16 --out /tmp/bench.json
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    e2e_s: float = 0.0
    error: str = ""


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0-100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def _sse_lines(response: httpx.Response):
    """SSE lines split at CR/LF only (str.splitlines would also split at U+0085, U+2028)."""
    buf = ""
    async for text in response.aiter_text():
        buf += text
        *lines, buf = buf.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for line in lines:
            yield line
    if buf:
        yield buf


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int
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
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in _sse_lines(r):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"]
                if not choice:
                    continue
                lp = choice[0].get("logprobs") or {}
                n = len(lp.get("tokens") or []) or (1 if choice[0].get("text") else 0)
                if n == 0:
                    continue
                now = time.perf_counter()
                if result.output_tokens == 0:
                    result.ttft_s = now - start
                    n_gaps = n - 1
                else:
                    n_gaps = n
                # Several tokens in one chunk arrived together: spread the gap over them.
                result.itl_s += [(now - last) / max(n, 1)] * n_gaps
                result.output_tokens += n
                last = now
        result.e2e_s = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_level(
    url: str, model: str, clients: int, per_client: int, prompt_len: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed + clients)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30), limits=limits) as client:

        async def worker() -> list[RequestResult]:
            out = []
            for _ in range(per_client):
                prompt = [
                    rng.randrange(10, 250) for _ in range(prompt_len)
                ]  # ids valid in any vocab >= 256
                out.append(await one_request(client, url, model, prompt, max_tokens))
            return out

        t0 = time.perf_counter()
        results = [
            r for batch in await asyncio.gather(*(worker() for _ in range(clients))) for r in batch
        ]
        wall = time.perf_counter() - t0
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s * 1000 for r in ok]
    itl = [x * 1000 for r in ok for x in r.itl_s]
    tokens = sum(r.output_tokens for r in ok)
    return {
        "clients": clients,
        "requests": len(results),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "wall_s": round(wall, 3),
        "output_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 2) if wall > 0 else 0.0,
        "requests_per_s": round(len(ok) / wall, 3) if wall > 0 else 0.0,
        "ttft_ms": {
            "median": round(statistics.median(ttft), 3) if ttft else 0.0,
            "p99": round(percentile(ttft, 99), 3),
        },
        "itl_ms": {
            "median": round(statistics.median(itl), 3) if itl else 0.0,
            "p99": round(percentile(itl, 99), 3),
        },
        "e2e_ms": {
            "median": round(statistics.median([r.e2e_s * 1000 for r in ok]), 3) if ok else 0.0
        },
    }


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "atom.cli.main",
        "serve",
        "--model",
        args.model,
        "--load-format",
        args.load_format,
        "--dtype",
        args.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.port),
        "--max-num-seqs",
        str(max(args.clients) * 2),
        *(["--level", str(args.level)] if args.level is not None else []),
        *args.server_arg,
    ]
    print("starting:", " ".join(cmd), flush=True)
    log = open(args.server_log, "wb")  # noqa: SIM115 (lives as long as the server)
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {args.server_log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server not healthy after {args.start_timeout}s; see {args.server_log}")


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'clients':>7} {'reqs':>5} {'fail':>4} {'tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>9} {'ITL p99':>9}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['clients']:>7} {r['requests']:>5} {r['failed']:>4} {r['throughput_tok_s']:>10.1f} "
            f"{r['ttft_ms']['median']:>8.1f}ms {r['ttft_ms']['p99']:>8.1f}ms {r['itl_ms']['median']:>7.2f}ms {r['itl_ms']['p99']:>7.2f}ms"
        )


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", help="a running server; otherwise one is started with the flags below")
    p.add_argument("--model", default="llama-3.2-1b")
    p.add_argument(
        "--served-model-name", default=None, help="model name to send (default: from /v1/models)"
    )
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--level", type=int, default=None)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra serve flag (repeat), e.g. --server-arg=--cudagraph-mode=FULL",
    )
    p.add_argument("--server-log", default="/tmp/atom-serve-bench-server.log")
    p.add_argument("--start-timeout", type=float, default=1800.0)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--warmup-requests", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    url = url.rstrip("/")
    try:
        model = (
            args.served_model_name
            or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        )
        status = httpx.get(url + "/status", timeout=10).json()
        for _ in range(args.warmup_requests):
            asyncio.run(
                run_level(
                    url, model, 1, 1, args.prompt_len, min(args.max_tokens, 8), args.seed + 999
                )
            )
        rows = []
        for clients in args.clients:
            row = asyncio.run(
                run_level(
                    url,
                    model,
                    clients,
                    args.requests_per_client,
                    args.prompt_len,
                    args.max_tokens,
                    args.seed,
                )
            )
            rows.append(row)
            print(
                f"{clients} client(s): {row['throughput_tok_s']} tok/s, {row['failed']} failed",
                flush=True,
            )
        print()
        print(
            f"model={model} level={status.get('level')} mode={status.get('mode')} effective_mode={status.get('effective_mode')} "
            f"prompt={args.prompt_len} output={args.max_tokens} tokens, {args.requests_per_client} requests/client"
        )
        print_table(rows)
        report = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "commit": git_commit(),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "host": platform.node(),
            "model": model,
            "server_status": {
                k: status.get(k)
                for k in (
                    "level",
                    "mode",
                    "effective_mode",
                    "buckets",
                    "captured_buckets",
                    "device",
                    "dtype",
                    "max_num_seqs",
                    "cache_key",
                )
            },
            "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens,
            "requests_per_client": args.requests_per_client,
            "results": rows,
        }
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2))
            print(f"wrote {args.out}")
        return 0 if all(r["failed"] == 0 for r in rows) else 1
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
