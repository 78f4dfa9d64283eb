"""Paged attention in plain torch: the CPU path and the reference the Triton kernels are tested against.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]. Sequence i owns query rows
cu_seqlens_q[i]:cu_seqlens_q[i+1] and, after this step's keys are written, context_lens[i]
keys; its query rows are the last positions of that context (causal within the step).
An FP8 cache (atom.kernels.fp8_cache) holds value / scale: k_scale and v_scale, per tensor.
"""

from __future__ import annotations

import torch

from atom.kernels.fp8_cache import DEFAULT_KV_SCALE, from_cache, scatter_rows, to_cache


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, k_scale: float = DEFAULT_KV_SCALE,
                   v_scale: float = DEFAULT_KV_SCALE) -> None:
    """Scatter rows into their cache slots; slot -1 marks a padding row and is skipped."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    rows = slot_mapping.shape[0]
    keep = slot_mapping[:rows] >= 0
    slots = slot_mapping[:rows][keep].long()
    if slots.numel() == 0:
        return
    k_rows = k[:rows].reshape(rows, num_kv_heads, head_dim)[keep]
    v_rows = v[:rows].reshape(rows, num_kv_heads, head_dim)[keep]
    scatter_rows(k_cache, slots, to_cache(k_rows, k_cache, k_scale))
    scatter_rows(v_cache, slots, to_cache(v_rows, v_cache, v_scale))


# Sequences are attended together, padded to the longest, while the padded score tensor stays
# under this many elements (fp32: 256 MiB); a larger step is cut into groups of sequences. A
# per-sequence loop cost 600 small launches a step for 20 sequences of a 30-layer model.
SCORE_BUDGET = 1 << 26


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          out: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                          block_tables: torch.Tensor, scale: float, num_heads: int,
                          k_scale: float = DEFAULT_KV_SCALE,
                          v_scale: float = DEFAULT_KV_SCALE) -> None:
    """out[rows] = causal softmax(q k^T * scale) v per sequence, in fp32; uncovered rows get 0."""
    head_dim = k_cache.shape[3]
    qh = q.reshape(q.shape[0], num_heads, head_dim)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    out.zero_()
    live = [i for i, length in enumerate(ctx) if length > 0 and cu[i + 1] > cu[i]]
    group: list[int] = []
    q_max = k_max = 0
    for i in live:
        nq, nk = max(q_max, cu[i + 1] - cu[i]), max(k_max, ctx[i])
        if group and (len(group) + 1) * num_heads * nq * nk > SCORE_BUDGET:
            _attend_group(qh, k_cache, v_cache, out, cu, ctx, block_tables, scale, group,
                          (k_scale, v_scale))
            group, nq, nk = [], cu[i + 1] - cu[i], ctx[i]
        group.append(i)
        q_max, k_max = nq, nk
    if group:
        _attend_group(qh, k_cache, v_cache, out, cu, ctx, block_tables, scale, group,
                      (k_scale, v_scale))


def _attend_group(qh: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, cu: list[int], ctx: list[int], block_tables: torch.Tensor,
                  scale: float, seqs: list[int], kv_scales: tuple[float, float]) -> None:
    """Attention of several sequences at once, each padded to the group's longest query and
    context; padded keys and query rows are masked, and only real rows are written."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    num_heads = qh.shape[1]
    group = num_heads // num_kv_heads
    dev = qh.device
    q_lens = [cu[i + 1] - cu[i] for i in seqs]
    lens = [ctx[i] for i in seqs]
    q_max, k_max = max(q_lens), max(lens)
    nblocks = (k_max + block_size - 1) // block_size
    idx = torch.tensor(seqs, device=dev)
    blocks = block_tables[idx, :nblocks].long().clamp_min(0)  # unused table slots may be -1
    keys = from_cache(k_cache[blocks].reshape(len(seqs), -1, num_kv_heads, head_dim)[:, :k_max],
                      kv_scales[0])
    vals = from_cache(v_cache[blocks].reshape(len(seqs), -1, num_kv_heads, head_dim)[:, :k_max],
                      kv_scales[1])
    # Query row j of sequence s sits at row cu[s] + j; padded rows read row 0 and are masked.
    offs = torch.arange(q_max, device=dev)
    qlen_t = torch.tensor(q_lens, device=dev)
    rows = torch.tensor([cu[i] for i in seqs], device=dev)[:, None] + offs
    real = offs[None, :] < qlen_t[:, None]
    rows = torch.where(real, rows, torch.zeros_like(rows))
    qs = qh[rows].float().reshape(len(seqs), q_max, num_kv_heads, group, head_dim)
    scores = torch.einsum("sqhgd,skhd->shgqk", qs, keys) * scale
    len_t = torch.tensor(lens, device=dev)
    q_pos = len_t[:, None] - qlen_t[:, None] + offs[None, :]  # [S, Q]
    k_pos = torch.arange(k_max, device=dev)
    masked = (k_pos[None, None, :] > q_pos[:, :, None]) | (k_pos[None, None, :] >= len_t[:, None, None])
    scores.masked_fill_(masked[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # a padded row masks every key
    o = torch.einsum("shgqk,skhd->sqhgd", probs, vals).reshape(len(seqs), q_max, -1)
    out[rows[real]] = o[real].to(out.dtype)
