"""Soak: many requests with aborts against one server; RSS of both processes every 1,000.

Starts `atom-runtime serve` (CPU tiny-llama, level 0, unless told otherwise), then sends
--requests requests from --concurrency aiohttp clients: a mix of streaming and whole
completions and chats, every --abort-every-th one hung up after its first event, every
--large-every-th one a --large-kb body far above the context (parsed, tokenized, refused). Every
1,000 requests it prints the resident memory (VmRSS) of the API server and of the engine
core; at the end the slope over the second half (MB per 1,000 requests), which is ~0 once
memory has plateaued.

    python bench/soak_bench.py                       # 20,000 requests
    python bench/soak_bench.py --requests 3000 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares MB per 1,000 requests."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return 1000 * sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


async def one(session: Any, url: str, model: str, i: int, args: argparse.Namespace) -> str:
    import aiohttp

    chat, stream = i % 2 == 0, i % 3 != 0
    abort = args.abort_every and i % args.abort_every == 0
    large = args.large_every and i % args.large_every == 1
    stream = stream or abort
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.max_tokens + i % 7,
        "ignore_eos": True,
        "stream": stream,
        "temperature": 0.0 if i % 4 else 0.8,
    }
    if i % 4 == 0:
        body["seed"] = i  # a generator per request in the engine
    if i % 8 in (2, 3):  # chat takes a boolean, completions a count
        body["logprobs"] = True if chat else 1
    prompt = f"soak request {i} " + "x" * (i % 97)
    if large:  # a legal body far above the context: parsed and tokenized, then a 400
        prompt += " y" * (args.large_kb * 512)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    try:
        async with session.post(url + path, json=body) as r:
            if r.status != 200:
                return f"http_{r.status}"
            if abort:
                async for _ in r.content.iter_any():
                    break  # hang up after the first bytes
                r.close()
                return "aborted"
            await r.read()
            return "ok"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def soak(args: argparse.Namespace, url: str, pids: dict[str, int], model: str) -> dict:
    import aiohttp

    samples: list[dict[str, Any]] = []
    outcomes: dict[str, int] = {}
    next_i = 0
    done = 0
    lock = asyncio.Lock()
    t0 = time.monotonic()

    def sample() -> None:
        row = {"requests": done, "elapsed_s": round(time.monotonic() - t0, 1)}
        row.update({f"{k}_rss_mb": round(rss_mb(p), 1) for k, p in pids.items()})
        samples.append(row)
        print(json.dumps(row), flush=True)

    sample()
    # --new-connections: one TCP connection per request, as many clients behave.
    conn = aiohttp.TCPConnector(limit=args.concurrency + 4, force_close=args.new_connections)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker() -> None:
            nonlocal next_i, done
            while True:
                async with lock:
                    if next_i >= args.requests:
                        return
                    i, next_i = next_i, next_i + 1
                out = await one(session, url, model, i, args)
                outcomes[out] = outcomes.get(out, 0) + 1
                done += 1
                if done % 1000 == 0:
                    sample()

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    if done % 1000:
        sample()
    half = [s for s in samples if s["requests"] >= args.requests // 2]
    return {
        "requests": args.requests,
        "outcomes": outcomes,
        "samples": samples,
        "slope_mb_per_1000": {
            k: round(slope([(s["requests"], s[f"{k}_rss_mb"]) for s in half]), 3) for k in pids
        },
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument(
        "--abort-every", type=int, default=5, help="hang up every n-th request (0: none)"
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--new-connections", action="store_true", help="no keep-alive reuse")
    p.add_argument("--large-every", type=int, default=10, help="every n-th body is large (0: none)")
    p.add_argument("--large-kb", type=int, default=512, help="size of the large bodies")
    p.add_argument("--port", type=int, default=8124)
    p.add_argument("--server-arg", action="append", default=[], help="extra serve flag (repeat)")
    p.add_argument("--server-log", default="/tmp/atom-soak-server.log")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    tiny = "--model tiny-llama --load-format dummy --level 0 --dtype float32".split()
    cmd = [sys.executable, "-m", "atom.cli.main", "serve", *tiny]
    cmd += ["--host", "127.0.0.1", "--port", str(args.port), *args.server_arg]
    log = open(args.server_log, "wb")  # noqa: SIM115 (lives as long as the server)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        status = _wait_ready(url, proc)
        # A server from before the engine-core split has one process (no core_pid).
        pids = {"api": status.get("pid", proc.pid)}
        if status.get("core_pid"):
            pids["core"] = status["core_pid"]
        report = asyncio.run(soak(args, url, pids, status["served_model_name"]))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    print(json.dumps({k: report[k] for k in ("outcomes", "slope_mb_per_1000", "seconds")}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def _wait_ready(url: str, proc: subprocess.Popen) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/status", timeout=5) as r:
                status = json.loads(r.read())
            if status.get("ready") or status.get("state") == "ready":
                return status
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit("server not ready")


if __name__ == "__main__":
    sys.exit(main())
