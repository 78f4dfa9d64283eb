"""Random paged-cache layouts for testing attention kernels against the torch reference."""

from __future__ import annotations

import random
from dataclasses import dataclass

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
    tables, slots, cu = [], [], [0]
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


def compile_for_hopper(fn: object, signature: dict[str, str], constexprs: dict[str, object],
                       num_stages: int | None = None, aligned: tuple[str, ...] = ()) -> object:
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
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs,
                                        attrs=hints),
                              target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.asm["ptx"] and compiled.asm["cubin"], fn
    assert compiled.metadata.shared <= HOPPER_SHARED_MEMORY, (fn, constexprs,
                                                              compiled.metadata.shared)
    return compiled
