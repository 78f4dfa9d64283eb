"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested against.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Sequence i owns query rows
cu_seqlens_q[i]:cu_seqlens_q[i+1] and, after this step's keys are written, context_lens[i]
keys; its query rows are the last positions of that context (causal within the step).
"""

from __future__ import annotations

import torch


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Scatter rows into their cache slots; slot -1 marks a padding row and is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = slot_mapping.shape[0]
    keep = slot_mapping[:rows] >= 0
    slots = slot_mapping[:rows][keep].long()
    if slots.numel() == 0:
        return
    k_rows = k[:rows].reshape(rows, num_kv_heads, head_dim)[keep]
    v_rows = v[:rows].reshape(rows, num_kv_heads, head_dim)[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k_rows.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v_rows.to(v_cache.dtype))


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          out: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float, num_heads: int) -> None:
    """out[rows] = causal softmax(q k^T * scale) v per sequence, in fp32; uncovered rows get 0."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = num_heads // num_kv_heads
    rows = q.shape[0]
    qh = q.reshape(rows, num_heads, head_dim)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    out.zero_()
    for i, length in enumerate(ctx):
        start, end = cu[i], cu[i + 1]
        q_len = end - start
        if q_len <= 0 or length <= 0:
            continue
        nblocks = (length + block_size - 1) // block_size
        blocks = block_tables[i, :nblocks].long()
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        vals = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qh[start:end].float(), keys) * scale
        q_pos = torch.arange(length - q_len, length, device=q.device)
        k_pos = torch.arange(length, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("hqk,khd->qhd", probs, vals)
        out[start:end] = o.reshape(q_len, num_heads * head_dim).to(out.dtype)
