"""KV transfer benchmark: throughput of a pull, and the time to first token it adds.

Two processes on one machine, as a prefill and a decode instance would be:

- `transfer`: a child process holds prompt-sized runs of blocks in a KV cache of the model's
  shape (random values, no model) and serves them on a KV port; the parent pulls them
  (`atom.disagg.client.pull_kv`: TCP loopback, wire version 1) and writes them into its own
  cache. Reports MB, pull time, GB/s and the time to place the blocks.
- `ttft`: the child runs a prefill engine (`LLMEngine`, hold_kv) behind its KV server; the parent
  runs a decode engine with the same weights. Unified TTFT = the parent's engine runs the prompt
  itself. Disaggregated TTFT = prefill in the child (its answer read over a pipe) + pull +
  first output of the decode engine. Both continue to `--max-tokens` and must agree (greedy).
- `http` (CPU, needs the server's dependencies): real `atom-runtime serve` processes (unified,
  prefill, decode) and `atom-router`; TTFT of a streamed completion through the router vs the
  unified server, measured with http.client. Adds the router's two HTTP hops to `ttft`.

Needs only torch (+ the runtime package) for `transfer` and `ttft`: no aiohttp, pydantic or
openai, so it runs on a bare GPU machine.

    # CPU (what bench/RESULTS.md records)
    python bench/kv_transfer_bench.py --device cpu --out /tmp/kv-cpu.json
    # GPU: the Llama-3.2-1B shape and model in bfloat16 (parts transfer and ttft)
    python bench/kv_transfer_bench.py --device cuda --out /tmp/kv-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Two processes share the CPU: OpenMP threads that spin after each op would slow the other
# process's next step and skew the comparison (set before torch starts its thread pool).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from atom.disagg.client import pull_kv  # noqa: E402
from atom.disagg.handle import KVHandle  # noqa: E402
from atom.disagg.holds import KVHoldRegistry  # noqa: E402
from atom.disagg.kv_blocks import engine_layout, layout_of_cache, scatter_blocks  # noqa: E402
from atom.disagg.server import KVServer, KVSource  # noqa: E402
from atom.models.registry import BUILTIN_SHAPES  # noqa: E402
from common import REPO, emit_report, git_commit, start_router, start_server  # noqa: E402

BLOCK = 16
IDENTITY = "bench-kv-shape"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3)


def prompt_ids(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(3, vocab, (n - 1,), generator=g).tolist()


def cache_for(shape: str, blocks: int, dtype: str, device: str, seed: int = 0) -> torch.Tensor:
    cfg = BUILTIN_SHAPES[shape]
    dims = (2, cfg.num_hidden_layers, blocks + 1, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(dims, generator=gen, device=device).to(getattr(torch, dtype))


def engine_config(args: argparse.Namespace) -> Any:
    """The same Config (so the same random weights) in both processes."""
    from atom.config import CompilationConfig, Config

    cc: dict[str, Any] = {"level": args.level}
    if args.cudagraph_mode:
        cc["cudagraph_mode"] = args.cudagraph_mode
    return Config(
        model=args.model,
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        max_model_len=max(args.tokens) + args.max_tokens + BLOCK,
        num_kv_blocks=args.kv_blocks,
        max_num_seqs=8,
        compilation_config=CompilationConfig.from_dict(cc),
    )


# ---- the child: a prefill instance ---------------------------------------------------------------
async def serve_child(args: argparse.Namespace) -> None:
    """Serve blocks on a KV port; commands on stdin, one JSON answer per line on stdout."""
    loop = asyncio.get_running_loop()
    engine = None
    if args.child == "kv":
        cache = cache_for(args.shape, args.kv_blocks, args.dtype, args.device, seed=1)
        source = KVSource(layout_of_cache(cache, IDENTITY, args.shape), KVHoldRegistry(60), cache)
    else:
        from atom.engine import LLMEngine

        engine = LLMEngine(engine_config(args))
        engine.warmup()
        source = KVSource(engine_layout(engine), engine.kv_holds, engine.runner.kv_cache)
    server = KVServer(lambda: source)
    port = await server.start("127.0.0.1", 0)
    print(json.dumps({"port": port}), flush=True)
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        if engine is not None:
            engine.reclaim_kv()
        else:
            source.holds.reclaim()
        if cmd["op"] == "hold":  # a run of blocks, as a finished prefill leaves them
            n = (cmd["tokens"] + BLOCK - 1) // BLOCK
            source.holds.hold(cmd["handle"], list(range(n)), cmd["tokens"])
            print(json.dumps({"ok": True}), flush=True)
        elif cmd["op"] == "prefill":
            print(json.dumps(prefill(engine, cmd)), flush=True)
    await server.close()


def prefill(engine: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from atom.engine import SamplingParams

    t0 = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engine.add_request(cmd["handle"], cmd["prompt"], params, hold_kv=True)
    first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            first = out.new_token_ids[0]
    return {"first": first, "seconds": time.perf_counter() - t0}


class Child:
    def __init__(self, args: argparse.Namespace, mode: str) -> None:
        argv = [sys.executable, __file__, "--child", mode, *sys.argv[1:]]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
        )
        self.port = self.ask(None)["port"]

    def ask(self, cmd: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited with {self.proc.wait()}")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


def handle(name: str, layout: Any, port: int, tokens: list[int], first: int) -> KVHandle:
    return KVHandle(name, "127.0.0.1", port, layout.identity, layout.model,
                    layout.blocks_for(len(tokens)), tokens, first)  # fmt: skip


# ---- parts ---------------------------------------------------------------------------------------
async def bench_transfer(args: argparse.Namespace) -> list[dict[str, Any]]:
    child = Child(args, "kv")
    cache = cache_for(args.shape, args.kv_blocks, args.dtype, args.device)
    layout = layout_of_cache(cache, IDENTITY, args.shape)
    rows = []
    try:
        for tokens in args.tokens:
            pulls, places, n = [], [], layout.blocks_for(tokens)
            for rep in range(args.warmup + args.reps):
                name = f"t{tokens}-{rep}"
                child.ask({"op": "hold", "handle": name, "tokens": tokens})
                h = handle(name, layout, child.port, list(range(tokens)), 0)
                t0 = time.perf_counter()
                pulled = await pull_kv(h, layout, timeout=120)
                t1 = time.perf_counter()
                scatter_blocks(cache, list(range(1, n + 1)), pulled.blocks)
                sync(args.device)
                if rep >= args.warmup:
                    pulls.append(t1 - t0)
                    places.append(time.perf_counter() - t1)
            nbytes = n * layout.block_bytes
            rows.append({
                "tokens": tokens,
                "blocks": n,
                "mbytes": round(nbytes / 2**20, 2),
                "pull_ms": median_ms(pulls),
                "gbytes_per_s": round(nbytes / statistics.median(pulls) / 1e9, 2),
                "place_ms": median_ms(places),
            })  # fmt: skip
            print(json.dumps({"transfer": rows[-1]}), flush=True)
    finally:
        child.close()
    return rows


async def bench_ttft(args: argparse.Namespace) -> list[dict[str, Any]]:
    from atom.engine import LLMEngine, SamplingParams

    child = Child(args, "prefill")
    engine = LLMEngine(engine_config(args))
    engine.warmup()
    layout = engine_layout(engine)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []

    def first_then_rest(request_id: str) -> tuple[float, list[int]]:
        """Step until the request's first token (its time), then to the end."""
        t_first, tokens = 0.0, []
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    if not tokens:
                        sync(args.device)
                        t_first = time.perf_counter()
                    tokens += out.new_token_ids
        return t_first, tokens

    try:
        for tokens in args.tokens:
            uni, dis, pre, pull, same = [], [], [], [], True
            vocab = engine.hf_config.vocab_size
            for rep in range(args.warmup + args.reps):
                ids = prompt_ids(tokens, vocab, seed=rep)
                t0 = time.perf_counter()
                engine.add_request(f"u{tokens}-{rep}", ids, greedy)
                t_first, want = first_then_rest(f"u{tokens}-{rep}")
                t_uni = t_first - t0
                name = f"p{tokens}-{rep}"
                t0 = time.perf_counter()
                answer = child.ask({"op": "prefill", "handle": name, "prompt": ids})
                t_pre = time.perf_counter()
                pulled = await pull_kv(handle(name, layout, child.port, ids, answer["first"]),
                                       layout, timeout=120)  # fmt: skip
                t_pulled = time.perf_counter()
                rid = f"d{tokens}-{rep}"
                engine.add_prefilled_request(rid, ids, answer["first"], greedy, pulled.blocks)
                t_first, got = first_then_rest(rid)
                same &= got == want
                if rep >= args.warmup:
                    uni.append(t_uni)
                    dis.append(t_first - t0)
                    pre.append(t_pre - t0)
                    pull.append(t_pulled - t_pre)
            rows.append({
                "tokens": tokens,
                "unified_ttft_ms": median_ms(uni),
                "disagg_ttft_ms": median_ms(dis),
                # per-rep pairs: the machine's drift cancels out of the difference
                "added_ms": median_ms([d - u for d, u in zip(dis, uni, strict=True)]),
                "prefill_call_ms": median_ms(pre),
                "pull_ms": median_ms(pull),
                "same_greedy_tokens": same,
            })  # fmt: skip
            print(json.dumps({"ttft": rows[-1]}), flush=True)
    finally:
        child.close()
    return rows


def bench_http(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Real servers and the router (needs aiohttp, pydantic: the runtime's own dependencies)."""
    # dummy weights at level 0 whatever --level says, as these rows were always measured
    model = ["--model", args.model, "--load-format", "dummy", "--level", "0",
             "--dtype", args.dtype, "--max-num-seqs", "8",
             "--max-model-len", str(max(args.tokens) + args.max_tokens + BLOCK),
             "--num-kv-blocks", str(args.kv_blocks)]  # fmt: skip
    procs = [start_server(*model), start_server(*model, "--role", "prefill", "--kv-port", "0"),
             start_server(*model, "--role", "decode")]  # fmt: skip
    router = None
    rows = []
    try:
        for p in procs:
            p.wait_healthy(300)
        router = start_router([procs[1].url], [procs[2].url])
        router.wait_healthy()
        for tokens in args.tokens:
            times: dict[str, list[float]] = {"unified": [], "router": []}
            for rep in range(args.warmup + args.reps):
                ids = prompt_ids(tokens, 256 if "tiny" in args.model else 32000, seed=rep)
                for key, proc in (("unified", procs[0]), ("router", router)):
                    ttft = http_ttft(proc.port, args.model, ids, args.max_tokens)
                    if rep >= args.warmup:
                        times[key].append(ttft)
            rows.append({
                "tokens": tokens,
                "unified_ttft_ms": median_ms(times["unified"]),
                "router_ttft_ms": median_ms(times["router"]),
                "added_ms": median_ms(
                    [r - u for r, u in zip(times["router"], times["unified"], strict=True)]
                ),
            })  # fmt: skip
            print(json.dumps({"http": rows[-1]}), flush=True)
    finally:
        for p in [router, *procs]:
            if p is not None:
                p.stop()
    return rows


def http_ttft(port: int, model: str, ids: list[int], max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first data line."""
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    while not resp.readline().startswith(b"data: "):
        pass
    ttft = time.perf_counter() - t0
    resp.read()
    conn.close()
    return ttft


# ---- main ----------------------------------------------------------------------------------------
def tiny_with_positions(name: str, positions: int) -> str:
    """A built-in shape written as a model directory with more positions (tiny-llama has 2048)."""
    cfg = copy.deepcopy(BUILTIN_SHAPES[name])
    cfg.max_position_embeddings = positions
    path = Path(tempfile.gettempdir()) / f"atom-bench-{name}-{positions}"
    path.mkdir(exist_ok=True)
    data = {k: v for k, v in cfg.to_dict().items() if k not in ("name", "path")}
    (path / "config.json").write_text(json.dumps(data))
    return str(path)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", nargs="+", default=None, choices=["transfer", "ttft", "http"],
                   help="default: all on CPU; transfer and ttft on CUDA")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--shape", default="llama-3.2-1b", help="KV cache shape of `transfer`")
    p.add_argument("--model", default=None, help="model of `ttft`/`http` (default: tiny-llama "
                   "on CPU, written with --max-pos positions; llama-3.2-1b on CUDA)")  # fmt: skip
    p.add_argument("--max-pos", type=int, default=8192)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096])
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per request")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--kv-blocks", type=int, default=None, help="default: room for the prompts")
    p.add_argument("--level", type=int, default=0)
    p.add_argument("--cudagraph-mode", default=None)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.parts = args.parts or (["transfer", "ttft"] if cuda else ["transfer", "ttft", "http"])
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if args.model is None:
        cpu = not args.device.startswith("cuda")
        args.model = tiny_with_positions("tiny-llama", args.max_pos) if cpu else "llama-3.2-1b"
    need = 2 * ((max(args.tokens) + args.max_tokens) // BLOCK + 2)
    args.kv_blocks = args.kv_blocks or max(need, 64)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        asyncio.run(serve_child(args))
        return 0
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": git_commit(short=True),
        "command": " ".join(["python", "bench/kv_transfer_bench.py", *sys.argv[1:]]),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "shape": args.shape,
        "model": args.model,
    }
    if "transfer" in args.parts:
        result["transfer"] = asyncio.run(bench_transfer(args))
    if "ttft" in args.parts:
        result["ttft"] = asyncio.run(bench_ttft(args))
    if "http" in args.parts:
        result["http"] = bench_http(args)
    emit_report(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
