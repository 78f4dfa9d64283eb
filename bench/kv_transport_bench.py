"""KV transport benchmark (issue 32): one prompt's blocks pulled over each transport.

Two processes on one host, as a prefill and a decode instance would be: a child holds
prompt-sized runs of blocks in a KV cache of the model's shape (random values) on
`--prefill-device` and serves them behind `atom.disagg.server.KVServer` with every transport it
can offer; the parent, its cache on `--decode-device`, pulls each prompt with `--kv-transport`
forced to each of `--transports` in turn (so a transport that cannot run fails loudly instead
of falling back) and writes the blocks into its cache. Per transport and prompt length: MiB,
pull ms, GB/s, place ms and pull + place (the TTFT a decode instance adds before its first step).

    # the issue's runs: two GPUs of one host, Llama-3.2-1B shape in bfloat16
    python bench/kv_transport_bench.py --prefill-device cuda:0 --decode-device cuda:1 \
        --tokens 512 4096 32768 --transports cuda-ipc nccl tcp --out /tmp/kv-transport.json
    # CPU smoke (TCP only)
    python bench/kv_transport_bench.py --shape tiny-llama --dtype float32 --tokens 64 256 \
        --prefill-device cpu --decode-device cpu --transports tcp
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from typing import Any

import torch

from atom.disagg.client import pull_kv
from atom.disagg.handle import KVHandle
from atom.disagg.holds import KVHoldRegistry
from atom.disagg.kv_blocks import layout_of_cache, scatter_blocks
from atom.disagg.registry import build_transports
from atom.disagg.server import KVServer, KVSource
from atom.disagg.transport import TransportMode
from atom.models.registry import BUILTIN_SHAPES

BLOCK = 16
IDENTITY = "bench-kv-transport"


def cache_for(args: argparse.Namespace, device: str, seed: int) -> torch.Tensor:
    cfg = BUILTIN_SHAPES[args.shape]
    blocks = (max(args.tokens) + BLOCK - 1) // BLOCK
    dims = (2, cfg.num_hidden_layers, blocks + 1, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(dims, generator=gen, device=device).to(getattr(torch, args.dtype))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def child_main(args: argparse.Namespace, conn: Any) -> None:
    """The prefill: holds runs of blocks on request ("hold", handle, tokens) until "stop"."""

    async def serve() -> None:
        cache = cache_for(args, args.prefill_device, seed=1)
        holds = KVHoldRegistry(120.0)
        ts = build_transports(TransportMode.parse("auto"), cache, "127.0.0.1")
        server = KVServer(lambda: KVSource(layout_of_cache(cache, IDENTITY, args.shape), holds,
                                           cache, transports=ts))  # fmt: skip
        conn.send(await server.start("127.0.0.1", 0))
        loop = asyncio.get_running_loop()
        while (cmd := await loop.run_in_executor(None, conn.recv))[0] == "hold":
            holds.reclaim()
            _, name, tokens = cmd
            holds.hold(name, list(range((tokens + BLOCK - 1) // BLOCK)), tokens)
            conn.send(True)
        await server.close()
        ts.close()

    asyncio.run(serve())


async def bench(args: argparse.Namespace, port: int, conn: Any) -> list[dict[str, Any]]:
    cache = cache_for(args, args.decode_device, seed=2)
    layout = layout_of_cache(cache, IDENTITY, args.shape)
    rows = []
    for transport in args.transports:
        ts = build_transports(TransportMode.parse(transport), cache, "127.0.0.1")
        ts.check_start()  # a transport this machine cannot run fails here, naming why
        for tokens in args.tokens:
            n = layout.blocks_for(tokens)
            pulls, places, used = [], [], set()
            for rep in range(args.warmup + args.reps):
                name = f"{transport}-{tokens}-{rep}"
                conn.send(("hold", name, tokens))
                conn.recv()
                h = KVHandle(name, "127.0.0.1", port, layout.identity, layout.model, n,
                             list(range(tokens)), 0)  # fmt: skip
                t0 = time.perf_counter()
                pulled = await pull_kv(h, layout, timeout=120, transports=ts)
                t1 = time.perf_counter()
                scatter_blocks(cache, list(range(1, n + 1)), pulled.blocks)
                sync(args.decode_device)
                used.add(pulled.report.describe())
                if rep >= args.warmup:
                    pulls.append(t1 - t0)
                    places.append(time.perf_counter() - t1)
            nbytes = n * layout.block_bytes
            pull, place = statistics.median(pulls), statistics.median(places)
            rows.append({
                "transport": transport,
                "used": sorted(used),
                "tokens": tokens,
                "mbytes": round(nbytes / 2**20, 2),
                "pull_ms": round(pull * 1e3, 3),
                "gbytes_per_s": round(nbytes / pull / 1e9, 2),
                "place_ms": round(place * 1e3, 3),
                "added_ttft_ms": round((pull + place) * 1e3, 3),
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        ts.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(BUILTIN_SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--transports", nargs="+", default=["cuda-ipc", "nccl", "tcp"],
                   choices=["cuda-ipc", "nccl", "tcp"])  # fmt: skip
    p.add_argument("--prefill-device", default="cuda:0")
    p.add_argument("--decode-device", default="cuda:1")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=child_main, args=(args, child))
    proc.start()
    try:
        rows = asyncio.run(bench(args, parent.recv(), parent))
    finally:
        parent.send(("stop",))
        proc.join(60)
    result = {"args": vars(args), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
