"""What one dependency between two consecutive kernels costs, in microseconds per link, for
three ways of making a consumer kernel wait for the producer kernel before it, inside a CUDA
graph:

- stream: ordinary launches; the consumer starts after the producer ends.
- pdl:    programmatic dependent launch (`launch_pdl=True`); every program calls
          gdc_launch_dependents() as it starts, and waits with gdc_wait() before reading.
- flag:   launched as pdl, but no gdc_wait: each producer program counts its finished store
          (atomic add, release) and each consumer program spins (atomic read, acquire) until
          all producer programs have counted. The last consumer program past the wait re-arms
          the link's counters. Safe from deadlock only because a PDL consumer program is
          placed after every producer program has started (and so called launch_dependents).

The workload: a chain of --links kernels in a ring of int32 buffers, one per link. Link k's
P programs each read a 4 KiB slice of buffer k, slice (p + P // 2 + 1) % P (written by another
program of link k - 1), and write it plus one as slice p of buffer k + 1 (buffer 0 after the
last link, read by the first link of the next replay). Link 0 waits for nothing (the graph
orders it after the previous replay) and the last link signals nothing, so a chain holds
links - 1 dependencies; the time reported is still replay time / links. With --weight-mib
W > 0 each link first streams its own W MiB of read-only weights (zeros, different for every
link, so not L2-resident across the chain), as a GEMV would, before its wait (pipelined,
STAGES steps in flight). In pdl and flag modes every link releases its dependents as it
starts, so the next link, and the one after it, may be placed while this one waits: weight
streams of several links ahead can overlap, as far as the SMs hold their programs.

Timing: per (mode, P, weight size) one CUDA graph of the chain, 10 warm-up replays, then 5
batches of 40 replays timed with CUDA events; the number reported is the median batch's
microseconds per link. Correctness: the ring after every replay is a known rotation of its
start plus the number of links run, so any stale or wrong read in any replay shows in buffer 0
at the end; a mismatch, or a counter left non-zero, is printed loudly and the script exits 1.

    python3 bench/sync_latency.py --out $OUT/sync.json

Without CUDA on sm_90 or later it says so and exits 2. About 10 s on an H200.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MODES = ("stream", "pdl", "flag")
SLICE = 1024  # int32 values a program reads and writes: 4 KiB
WBLOCK = 4096  # int32 weight values a program loads per step: 16 KiB
STAGES = 3  # weight steps in flight (software pipelined through shared memory)
LINE = 32  # int32 values between a link's two counters: 128 bytes
WARPS = 4
WARMUP, BATCHES, PER_BATCH = 10, 5, 40
WATCHDOG_S = 150  # a mode that deadlocks dumps the stacks and exits 1 after this long


@triton.jit
def _stream_weights(w_ptr, n_w, WBLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Sum of the program's n_w weight values at w_ptr: a read-only stream, like a GEMV's."""
    offs = tl.arange(0, WBLOCK)
    acc = tl.zeros([WBLOCK], tl.int32)
    for start in tl.range(0, n_w, WBLOCK, num_stages=STAGES):
        acc += tl.load(w_ptr + start + offs, mask=start + offs < n_w, other=0)
    return tl.sum(acc, axis=0)


@triton.jit
def _wait_and_rearm(count_ptr, LINE: tl.constexpr):
    """Until every producer program has counted at count_ptr (acquire: their stores are
    visible after); then the last consumer program past the wait zeroes both counters."""
    n = tl.num_programs(0)  # producer and consumer grids are the same size
    seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    while seen < n:
        seen = tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu")
    passed = tl.atomic_add(count_ptr + LINE, 1, sem="relaxed", scope="gpu")
    if passed == n - 1:  # every consumer has seen the full count: none reads it again
        tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(count_ptr + LINE, 0, sem="relaxed", scope="gpu")


@triton.jit
def _signal(count_ptr):
    """Count this program's finished stores: every thread's are issued (barrier) before the
    release that publishes them at GPU scope."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _link_kernel(src_ptr, dst_ptr, w_ptr, n_w, wait_ptr, signal_ptr, MODE: tl.constexpr,
                 WAIT: tl.constexpr, SIGNAL: tl.constexpr, WEIGHTS: tl.constexpr,
                 SLICE: tl.constexpr, WBLOCK: tl.constexpr, STAGES: tl.constexpr,
                 LINE: tl.constexpr):
    """dst[p] = src[(p + P // 2 + 1) % P] + 1 (+ the sum of the program's weights, zero) for
    slices of SLICE values. WAIT: wait for the link before (MODE pdl: gdc_wait; flag: the
    count at wait_ptr). SIGNAL (flag): count the stores at signal_ptr."""
    if MODE != "stream":
        gdc_launch_dependents()
    pid = tl.program_id(0)
    acc = 0
    if WEIGHTS:
        acc = _stream_weights(w_ptr + pid * n_w, n_w, WBLOCK, STAGES)
    if WAIT:
        if MODE == "pdl":
            gdc_wait()
        if MODE == "flag":
            _wait_and_rearm(wait_ptr, LINE)
    n = tl.num_programs(0)
    src = (pid + n // 2 + 1) % n
    offs = tl.arange(0, SLICE)
    # Another program's (another SM's) output: read through L2.
    x = tl.load(src_ptr + src * SLICE + offs, cache_modifier=".cg")
    tl.store(dst_ptr + pid * SLICE + offs, x + 1 + acc)
    if SIGNAL:
        _signal(signal_ptr)


@dataclass
class Chain:
    """A ring of buffers [links, programs * SLICE], each link's weights [links, programs * n_w]
    (n_w = 0: none) and counters [links, 2 * LINE] (link k waits on row k)."""

    bufs: torch.Tensor
    weights: torch.Tensor
    n_w: int
    counters: torch.Tensor
    init: torch.Tensor

    @property
    def links(self) -> int:
        return self.bufs.shape[0]

    @property
    def programs(self) -> int:
        return self.bufs.shape[1] // SLICE


def make_chain(links: int, programs: int, weight_mib: int, device: torch.device) -> Chain:
    """Buffers for a chain; weight values per program rounded down to a multiple of 16."""
    n_w = (weight_mib * 2**20 // 4 // programs) // 16 * 16
    return Chain(
        bufs=torch.empty(links, programs * SLICE, dtype=torch.int32, device=device),
        weights=torch.zeros(links, max(programs * n_w, 16), dtype=torch.int32, device=device),
        n_w=n_w,
        counters=torch.zeros(links, 2 * LINE, dtype=torch.int32, device=device),
        init=torch.arange(programs * SLICE, dtype=torch.int32, device=device),
    )


def reset(chain: Chain) -> None:
    """Buffer 0 to its start, the others to garbage, the counters to zero."""
    chain.bufs[0].copy_(chain.init)
    chain.bufs[1:].fill_(-1)
    chain.counters.zero_()


def launch_chain(chain: Chain, mode: str) -> None:
    """The links on the current stream: link k reads buffer k and writes buffer k + 1."""
    links = chain.links
    for k in range(links):
        early = mode != "stream" and k > 0
        _link_kernel[(chain.programs,)](
            chain.bufs[k], chain.bufs[(k + 1) % links], chain.weights[k], chain.n_w,
            chain.counters[k], chain.counters[(k + 1) % links], MODE=mode, WAIT=early,
            SIGNAL=mode == "flag" and k < links - 1, WEIGHTS=chain.n_w > 0, SLICE=SLICE,
            WBLOCK=WBLOCK, STAGES=STAGES, LINE=LINE, launch_pdl=early, num_warps=WARPS)


def capture(chain: Chain, mode: str) -> torch.cuda.CUDAGraph:
    """The chain in one graph, after an eager run that compiles its kernels."""
    launch_chain(chain, mode)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_chain(chain, mode)
    return graph


def time_batches(graph: torch.cuda.CUDAGraph, links: int) -> list[float]:
    """Microseconds per link of each timed batch, after the warm-up replays."""
    for _ in range(WARMUP):
        graph.replay()
    out = []
    for _ in range(BATCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(PER_BATCH):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / PER_BATCH / links)
    return out


def expected(chain: Chain, links_run: int) -> torch.Tensor:
    """Buffer 0 after links_run links from reset: each link rotates the slices by
    P // 2 + 1 and adds one."""
    p = chain.programs
    start = chain.init.view(p, SLICE)
    return torch.roll(start, -(links_run * (p // 2 + 1) % p), dims=0).flatten() + links_run


def check(chain: Chain, replays: int) -> list[str]:
    """What is wrong with the chain's state after `replays` replays from reset."""
    torch.cuda.synchronize()
    errors = []
    want = expected(chain, replays * chain.links)
    wrong = (chain.bufs[0] != want).nonzero().flatten()
    if wrong.numel():
        i = int(wrong[0])
        errors.append(f"{wrong.numel()} of {want.numel()} values wrong; first at {i}: "
                      f"{int(chain.bufs[0][i])} != {int(want[i])}")
    if chain.counters.any():
        errors.append(f"counters not re-armed: {chain.counters.count_nonzero()} non-zero")
    return errors


def measure(chain: Chain, mode: str, weight_mib: int) -> dict[str, Any]:
    """One configuration: timed, then checked."""
    graph = capture(chain, mode)
    reset(chain)
    batches = time_batches(graph, chain.links)
    errors = check(chain, WARMUP + BATCHES * PER_BATCH)
    for e in errors:
        print(f"!!! MISMATCH mode={mode} P={chain.programs} weight_mib={weight_mib}: {e}",
              file=sys.stderr, flush=True)
    return {"mode": mode, "programs": chain.programs, "weight_mib": weight_mib,
            "weight_bytes_per_link": chain.programs * chain.n_w * 4,
            "us_per_link": statistics.median(batches), "batches_us_per_link": batches,
            "ok": not errors, "errors": errors}


def print_table(results: list[dict[str, Any]], modes: list[str]) -> None:
    """Microseconds per link, a row per (weight size, P), a column per mode."""
    table: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for r in results:
        table.setdefault((r["weight_mib"], r["programs"]), {})[r["mode"]] = r
    print(f"{'weight MiB':>10} {'P':>5} " + " ".join(f"{m:>10}" for m in modes))
    for (w, p), row in table.items():
        cells = [f"{row[m]['us_per_link']:9.2f}{'' if row[m]['ok'] else '!'}" for m in modes]
        print(f"{w:>10} {p:>5} " + " ".join(f"{c:>10}" for c in cells))
    print("(us per link, median of batches; ! = wrong result)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--links", type=int, default=64, help="kernels in a chain (>= 2)")
    parser.add_argument("--programs", type=int, nargs="+", default=[132, 264, 512])
    parser.add_argument("--weight-mib", type=int, nargs="+", default=[0, 8],
                        help="MiB of weights each link streams before its wait")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    if args.links < 2:
        parser.error("--links must be at least 2 (the buffers form a ring)")
    return args


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        print("sync_latency.py needs CUDA on sm_90 or later (programmatic dependent launch)",
              file=sys.stderr)
        return 2
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    device = torch.device("cuda")
    results = []
    for weight_mib in args.weight_mib:
        for programs in args.programs:
            chain = make_chain(args.links, programs, weight_mib, device)
            for mode in args.modes:
                results.append(measure(chain, mode, weight_mib))
                r = results[-1]
                print(f"{mode:>6} P={programs:<4} weight={weight_mib} MiB: "
                      f"{r['us_per_link']:.2f} us/link", flush=True)
            del chain
    faulthandler.cancel_dump_traceback_later()
    print_table(results, args.modes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "links": args.links,
                       "warmup": WARMUP, "batches": BATCHES, "replays_per_batch": PER_BATCH,
                       "results": results}, f, indent=1)
    failed = [r for r in results if not r["ok"]]
    if failed:
        print(f"!!! {len(failed)} configuration(s) gave wrong results: "
              + ", ".join(f"{r['mode']}/P={r['programs']}/W={r['weight_mib']}" for r in failed),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
