"""Random paged-cache layouts for testing attention kernels against the torch reference."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # [rows, heads*dim]
    k: torch.Tensor  # [rows, kv_heads*dim] this step's keys
    v: torch.Tensor
    k_cache: torch.Tensor  # [blocks, block_size, kv_heads, dim] holding earlier context
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [rows], -1 for padding rows
    cu_seqlens_q: torch.Tensor  # int32 [seqs + 1]
    context_lens: torch.Tensor  # int32 [seqs]
    block_tables: torch.Tensor  # int32 [seqs, max_blocks]
    num_seqs: int
    num_rows: int
    max_seqlen_q: int


def random_paged_batch(q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int = 16, num_blocks: int = 64,
                       max_blocks: int | None = None, pad_rows: int = 0, pad_seqs: int = 0,
                       dtype: torch.dtype = torch.float32, device: str = "cpu",
                       seed: int = 0) -> PagedBatch:
    """Sequences with shuffled physical blocks; ctx_lens[i] >= q_lens[i] counts this step's rows.

    Padding: pad_rows rows with slot -1 after the real rows; pad_seqs sequences with context 0
    (each owning one padding row when decode-shaped, i.e. when all q_lens are 1).
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [(c + block_size - 1) // block_size for c in ctx_lens]
    width = max_blocks or max(need + [1])
    physical = list(range(num_blocks))
    rng.shuffle(physical)
    assert sum(need) <= num_blocks, "not enough blocks for this layout"
    tables: list[list[int]] = []
    slots: list[int] = []
    cu = [0]
    it = iter(physical)
    for q, c, nb in zip(q_lens, ctx_lens, need, strict=True):
        table = [next(it) for _ in range(nb)]
        tables.append(table + [0] * (width - nb))
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c - q, c))
        cu.append(cu[-1] + q)
    decode_shaped = all(q == 1 for q in q_lens)
    for _ in range(pad_seqs):
        tables.append([0] * width)
        cu.append(cu[-1] + (1 if decode_shaped else 0))
    num_rows = sum(q_lens)
    rows = num_rows + pad_rows
    slots += [-1] * pad_rows

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    return PagedBatch(
        q=rand(rows, num_heads * head_dim), k=rand(rows, num_kv_heads * head_dim),
        v=rand(rows, num_kv_heads * head_dim),
        k_cache=rand(num_blocks, block_size, num_kv_heads, head_dim),
        v_cache=rand(num_blocks, block_size, num_kv_heads, head_dim),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(list(ctx_lens) + [0] * pad_seqs, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        num_seqs=len(q_lens), num_rows=num_rows, max_seqlen_q=max(q_lens),
    )


HOPPER_SHARED_MEMORY = 232448  # bytes per SM an H100/H200 launch may use (227 KiB)


class CompiledKernel(Protocol):
    """What is read here of Triton's compiled kernel (Triton ships no type information)."""

    asm: dict[str, Any]  # "ptx": str, "cubin": bytes, ...


def compile_for_hopper(fn: object, signature: dict[str, str], constexprs: dict[str, object],
                       num_stages: int | None = None, aligned: tuple[str, ...] = (),
                       num_warps: int | None = None) -> CompiledKernel:
    """Compile a Triton kernel ahead of time to sm_90 PTX and SASS, without a GPU, and check
    that it fits an SM's shared memory. Pointers, strides and the `aligned` arguments are
    marked 16-byte divisible, as a launch specialises them: that is what enables the
    asynchronous copies whose pipeline stages take shared memory, so the size checked is the
    one a launch would ask for."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    hints = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n.endswith("_ptr") or n.startswith("stride") or n in aligned}
    options = {} if num_stages is None else {"num_stages": num_stages}
    if num_warps is not None:
        options["num_warps"] = num_warps
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                        attrs=hints),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["ptx"] and compiled.asm["cubin"], fn
    assert compiled.metadata.shared <= HOPPER_SHARED_MEMORY, (fn, constexprs,
                                                              compiled.metadata.shared)
    return compiled


def hopper_registers(compiled: CompiledKernel) -> tuple[int, int]:
    """(registers per thread, spilled bytes) of an sm_90 kernel from compile_for_hopper, as
    Triton's bundled ptxas reports them (-v) for its PTX."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        ptx = f"{tmp}/kernel.ptx"
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        proc = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", ptx, "-o",
                               f"{tmp}/kernel.cubin"], capture_output=True, text=True, check=True)
    report = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert regs is not None, report
    return int(regs.group(1)), int(spills.group(1)) if spills else 0


def run_interpreter_case(script: str, name: str, timeout: float = 300) -> None:
    """Run `python script name` with TRITON_INTERPRET=1 and check it printed "ok name". Triton
    reads the switch when it is first imported, so each interpreter case is a fresh process."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, script, name], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"ok {name}" in proc.stdout


def paged_reference(b: PagedBatch, num_heads: int, scale: float,
                    positions: torch.Tensor | None = None, max_positions: int = 256
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """The torch reference for b: (attention output, k cache and v cache after this step's
    store, the Rope handed to the kernels or None). With positions, q and k are taken as
    unrotated and rotated (theta 10000) before the reference stores and attends."""
    from atom.kernels.paged_attention_torch import paged_attention_torch, write_kv_torch
    from atom.kernels.rotary import Rope, apply_rotary, rope_tables

    q, k, rope = b.q, b.k, None
    if positions is not None:
        dim = b.k_cache.shape[3]
        cos, sin = (t.to(b.q.device) for t in rope_tables(dim, max_positions=max_positions,
                                                          theta=10000.0))
        rope = Rope(positions, cos, sin)
        q = apply_rotary(q, positions, rope.cos, rope.sin, dim)
        k = apply_rotary(k, positions, rope.cos, rope.sin, dim)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    write_kv_torch(k, b.v, kc, vc, b.slot_mapping)
    out = torch.full_like(b.q, float("nan"))  # every row is the reference's to write
    paged_attention_torch(q, kc, vc, out, b.cu_seqlens_q, b.context_lens, b.block_tables, scale,
                          num_heads)
    return out, kc, vc, rope
