"""How fast persistent programs, one per SM, can stream weight tiles from HBM (issue 5).

A question for a one-launch decode forward: can one program per SM keep a batch-1 weight stream
at the device's read rate, and how must it issue its loads? Each program streams its own
contiguous rows of a 2 GiB bf16 matrix [rows, 2048] as tiles of ROWS x BLOCK_K, multiplying
each by the matching chunk of an input vector (as a GEMV does) into per-row sums:
- "ring": the next DEPTH tiles' loads issued ahead into registers (the loop unrolled DEPTH
  times, each slot reloaded as soon as it is used), no shared memory;
- "pipelined": a plain loop over the tiles, pipelined by Triton (num_stages, via shared memory);
- "tma": the plain loop with each tile fetched by TMA into the pipeline;
- "phased": the TMA loop cut into phases with grid-wide barriers between them, the weight
  loads running on across the barriers, the input read in the ways a real kernel could (or
  could not) read an input that other programs write (_phased_kernel).
Beside them: a copy of the same bytes (torch) and one program per tile row group (many
programs a SM, scheduled by the hardware). Median of 20 timed calls; TB/s of weight bytes read.
Figures: bench/RESULTS.md; what they decided: docs/performance.md (the 3x target at batch 1).

    python bench/stream_rate.py --out stream.json [--tma-only]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(w_ptr, t, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, KC: tl.constexpr):
    """Tile t: rows (t // KC) * ROWS.., columns (t % KC) * BLOCK_K.."""
    rows = (t // KC) * ROWS + tl.arange(0, ROWS)
    cols = (t % KC) * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + cols[None, :])


@triton.jit
def _use(acc, w, x_ptr, t, BLOCK_K: tl.constexpr, KC: tl.constexpr):
    xk = tl.load(x_ptr + (t % KC) * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
    return acc + tl.sum(w.to(tl.float32) * xk[None, :], axis=1)


@triton.jit
def _ring_kernel(w_ptr, x_ptr, y_ptr, tiles, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                 KC: tl.constexpr, DEPTH: tl.constexpr):
    """tiles per program, DEPTH (2 to 4) tile loads always in flight ahead of the use."""
    pid = tl.program_id(0)
    t0 = pid * tiles
    last = t0 + tiles - 1
    acc = tl.zeros([ROWS], tl.float32)
    b0 = _tile(w_ptr, t0, K, ROWS, BLOCK_K, KC)
    b1 = _tile(w_ptr, tl.minimum(t0 + 1, last), K, ROWS, BLOCK_K, KC)
    b2 = b1
    b3 = b1
    if DEPTH >= 3:
        b2 = _tile(w_ptr, tl.minimum(t0 + 2, last), K, ROWS, BLOCK_K, KC)
    if DEPTH >= 4:
        b3 = _tile(w_ptr, tl.minimum(t0 + 3, last), K, ROWS, BLOCK_K, KC)
    for i in range(0, tiles, DEPTH):
        t = t0 + i
        acc = _use(acc, b0, x_ptr, t, BLOCK_K, KC)
        b0 = _tile(w_ptr, tl.minimum(t + DEPTH, last), K, ROWS, BLOCK_K, KC)
        acc = _use(acc, b1, x_ptr, t + 1, BLOCK_K, KC)
        b1 = _tile(w_ptr, tl.minimum(t + 1 + DEPTH, last), K, ROWS, BLOCK_K, KC)
        if DEPTH >= 3:
            acc = _use(acc, b2, x_ptr, t + 2, BLOCK_K, KC)
            b2 = _tile(w_ptr, tl.minimum(t + 2 + DEPTH, last), K, ROWS, BLOCK_K, KC)
        if DEPTH >= 4:
            acc = _use(acc, b3, x_ptr, t + 3, BLOCK_K, KC)
            b3 = _tile(w_ptr, tl.minimum(t + 3 + DEPTH, last), K, ROWS, BLOCK_K, KC)
    tl.store(y_ptr + pid * ROWS + tl.arange(0, ROWS), acc)


@triton.jit
def _pipelined_kernel(w_ptr, x_ptr, y_ptr, tiles, K, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                      KC: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([ROWS], tl.float32)
    for i in range(0, tiles):
        t = pid * tiles + i
        acc = _use(acc, _tile(w_ptr, t, K, ROWS, BLOCK_K, KC), x_ptr, t, BLOCK_K, KC)
    tl.store(y_ptr + pid * ROWS + tl.arange(0, ROWS), acc)


@triton.jit
def _tma_kernel(desc, x_ptr, y_ptr, tiles, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                KC: tl.constexpr, STAGES: tl.constexpr):
    """The plain loop with each tile fetched by the tensor memory accelerator into shared
    memory (a host-built descriptor), STAGES tiles in flight: no registers held per load."""
    pid = tl.program_id(0)
    acc = tl.zeros([ROWS], tl.float32)
    for i in tl.range(0, tiles, num_stages=STAGES):
        t = pid * tiles + i
        w = desc.load([(t // KC) * ROWS, (t % KC) * BLOCK_K])
        acc = _use(acc, w, x_ptr, t, BLOCK_K, KC)
    tl.store(y_ptr + pid * ROWS + tl.arange(0, ROWS), acc)


@triton.jit
def _spin_until(count_ptr, target):
    """Until the int32 at count_ptr reaches target (acquire); one inline-asm op, so the loop
    around it stays a pipelinable loop."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        SPIN_${:uid}:
        ld.acquire.gpu.global.u32 $0, [$1];
        setp.lt.u32 p, $0, $2;
        @p bra SPIN_${:uid};
        }""", "=r,l,r", [count_ptr, target], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _arrive_asm(count_ptr):
    """Add 1 at count_ptr with release semantics, once per program, after every thread of it
    has got here (bar.sync). By inline asm: an atomic op or tl.debug_barrier in the loop would
    stop Triton from pipelining it."""
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .u32 tid;
        bar.sync 0;
        mov.u32 tid, %tid.x;
        setp.eq.u32 p, tid, 0;
        @p red.release.gpu.global.add.u32 [$1], 1;
        mov.u32 $0, 0;
        }""", "=r,l", [count_ptr], dtype=tl.uint32, is_pure=False, pack=1)


@triton.jit
def _chunk(x_ptr, c, BLOCK_K: tl.constexpr):
    return tl.load(x_ptr + c * BLOCK_K + tl.arange(0, BLOCK_K), cache_modifier=".cg")


@triton.jit
def _phased_kernel(desc, x_ptr, count_ptr, y_ptr, tiles, ROWS: tl.constexpr,
                   BLOCK_K: tl.constexpr, KC: tl.constexpr, PHASE: tl.constexpr,
                   GROUPS: tl.constexpr, STAGES: tl.constexpr, BARRIER: tl.constexpr,
                   HELD: tl.constexpr):
    """The TMA loop, cut into phases of PHASE tiles with a grid-wide barrier between them
    (BARRIER): a program counts itself at count_ptr after its phase's last tile and, before
    its next phase's first, waits until every program has. The weight loads never wait:
    they run stages - 1 tiles ahead across the barrier. The input chunk: HELD, the phase's
    whole input (KC == 8 chunks) read into registers after the wait and each tile's chunk
    picked by selects; else read in a conditional block once per GROUPS tiles (GROUPS 1: by
    pipelined loads, which a real kernel could not use: they run ahead of the wait)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([ROWS], tl.float32)
    xk = tl.zeros([BLOCK_K], tl.float32)
    x0 = tl.zeros([BLOCK_K], tl.bfloat16)
    x1 = x0
    x2 = x0
    x3 = x0
    x4 = x0
    x5 = x0
    x6 = x0
    x7 = x0
    for i in tl.range(0, tiles, num_stages=STAGES):
        t = pid * tiles + i
        w = desc.load([(t // KC) * ROWS, (t % KC) * BLOCK_K])
        if HELD:
            tl.static_assert(KC == 8)
            if i % PHASE == 0:
                if BARRIER and i > 0:
                    _spin_until(count_ptr, (programs * (i // PHASE)).to(tl.uint32))
                x0 = _chunk(x_ptr, 0, BLOCK_K)
                x1 = _chunk(x_ptr, 1, BLOCK_K)
                x2 = _chunk(x_ptr, 2, BLOCK_K)
                x3 = _chunk(x_ptr, 3, BLOCK_K)
                x4 = _chunk(x_ptr, 4, BLOCK_K)
                x5 = _chunk(x_ptr, 5, BLOCK_K)
                x6 = _chunk(x_ptr, 6, BLOCK_K)
                x7 = _chunk(x_ptr, 7, BLOCK_K)
            c = t % KC
            xs = tl.where(c == 0, x0, tl.where(c == 1, x1, tl.where(c == 2, x2, tl.where(
                c == 3, x3, tl.where(c == 4, x4, tl.where(c == 5, x5, tl.where(
                    c == 6, x6, x7)))))))
            xk = xs.to(tl.float32)
        elif i % GROUPS == 0:
            if BARRIER and i % PHASE == 0 and i > 0:
                _spin_until(count_ptr, (programs * (i // PHASE)).to(tl.uint32))
            xk = _chunk(x_ptr, (i // GROUPS) % KC, BLOCK_K).to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        if BARRIER and (i + 1) % PHASE == 0:
            _arrive_asm(count_ptr)
    tl.store(y_ptr + pid * ROWS + tl.arange(0, ROWS), acc)


def timed(fn, iters: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def rate(kernel, programs: int, used: int, args: tuple, **kw) -> float | str:
    """TB/s of `used` weight bytes read by one launch, or why it did not run."""
    def launch() -> None:
        kernel[(programs,)](*args, **kw)
    try:
        return used / timed(launch) / 1e12
    except Exception as exc:  # out of registers or shared memory  # noqa: BLE001
        return repr(exc)[:80]


def split_rows(rows: int, row_tile: int, block_k: int, programs: int, multiple: int,
               K: int) -> tuple[int, int, int, torch.Tensor]:
    """(K chunks a row, tiles a program, weight bytes they cover, per-row output) for
    `programs` programs taking equal runs of tiles, a multiple of `multiple` each."""
    kc = K // block_k
    tiles = rows // row_tile * kc // programs // multiple * multiple
    y = torch.empty(programs * row_tile, device="cuda", dtype=torch.float32)
    return kc, tiles, tiles * programs * row_tile * block_k * 2, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tma-only", action="store_true",
                    help="only the TMA and phased rows (not the pointer-load schemes)")
    args = ap.parse_args()
    K = 2048
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = int(args.gib * (1 << 30)) // (K * 2)
    w = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(K, device="cuda", dtype=torch.bfloat16)
    nbytes = w.numel() * 2
    out: dict[str, float | str] = {}
    copy = torch.empty_like(w)
    out["torch copy (read + write)"] = nbytes * 2 / timed(lambda: copy.copy_(w)) / 1e12
    copy = None
    from triton.tools.tensor_descriptor import TensorDescriptor

    for row_tile, block_k in ((32, 256), (64, 256), (64, 128)):
        kc, tiles, used, y = split_rows(rows, row_tile, block_k, sms, 4, K)
        desc = TensorDescriptor.from_tensor(w, [row_tile, block_k])
        for warps in (4, 8):
            for stages in (4, 6, 8):
                name = f"tma {row_tile}x{block_k} stages {stages} warps {warps} x{sms}"
                out[name] = rate(_tma_kernel, sms, used, (desc, x, y, tiles), ROWS=row_tile,
                                 BLOCK_K=block_k, KC=kc, STAGES=stages, num_warps=warps)
                print(name, out[name], flush=True)
    # Phases with grid-wide barriers between them, the weight stream running on across them.
    row_tile, block_k = 32, 256
    kc, tiles, used, y = split_rows(rows, row_tile, block_k, sms, 64, K)
    desc = TensorDescriptor.from_tensor(w, [row_tile, block_k])
    count = torch.zeros(1, device="cuda", dtype=torch.int32)
    for barrier in (False, True):
        for phase in (8, 32, 64):
            for groups, held in ((1, False), (4, False), (1, True)):
                how = "held in registers" if held else f"read every {groups}"
                name = f"phased {phase} tiles, x {how}, barrier {barrier}"

                def launch(b=barrier, p=phase, g=groups, h=held) -> None:
                    count.zero_()
                    _phased_kernel[(sms,)](desc, x, count, y, tiles, ROWS=row_tile,
                                           BLOCK_K=block_k, KC=kc, PHASE=p, GROUPS=g,
                                           STAGES=6, BARRIER=b, HELD=h, num_warps=4)
                # the zeroing kernel (a few us) is in the timed span: charged to every variant
                out[name] = used / timed(launch) / 1e12
                print(name, out[name], flush=True)
    ring_tiles = () if args.tma_only else ((8, 1024), (16, 512), (16, 1024), (32, 256))
    for row_tile, block_k in ring_tiles:
        kc, tiles, used, y = split_rows(rows, row_tile, block_k, sms, 4, K)
        shape = dict(ROWS=row_tile, BLOCK_K=block_k, KC=kc)
        for warps in (4, 8):
            for depth in (2, 3, 4):
                name = f"ring {row_tile}x{block_k} depth {depth} warps {warps} x{sms}"
                out[name] = rate(_ring_kernel, sms, used, (w, x, y, tiles, K), DEPTH=depth,
                                 num_warps=warps, **shape)
                print(name, out[name], flush=True)
            for stages in (3, 6):
                name = f"pipelined {row_tile}x{block_k} stages {stages} warps {warps} x{sms}"
                out[name] = rate(_pipelined_kernel, sms, used, (w, x, y, tiles, K),
                                 num_warps=warps, num_stages=stages, **shape)
                print(name, out[name], flush=True)
        # 64 tiles a program, many programs a SM (placed by the hardware)
        programs = rows // row_tile * kc // 64
        y = torch.empty(programs * row_tile, device="cuda", dtype=torch.float32)
        name = f"many programs {row_tile}x{block_k} stages 3 warps 4 x{programs}"
        out[name] = rate(_pipelined_kernel, programs, programs * 64 * row_tile * block_k * 2,
                         (w, x, y, 64, K), num_warps=4, num_stages=3, **shape)
        print(name, out[name], flush=True)
    result = {"device": torch.cuda.get_device_name(), "sms": sms, "bytes": nbytes,
              "tb_per_s": {k: (round(v, 3) if isinstance(v, float) else v)
                           for k, v in out.items()}}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
