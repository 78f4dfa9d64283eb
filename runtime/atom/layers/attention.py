"""Paged attention: the `Attention` module and the registered split op.

The model calls `torch.ops.aiter.unified_attention_with_output(q, k, v, output, layer_id,
positions, cos_cache, sin_cache, o_weight, o_bias, residual, proj_out)` with unrotated q and k
(positions and the tables may be left out for q and k rotated already). Dynamo sees one
opaque node (the split point of piecewise compilation); the impl runs eagerly, finds its
layer (KV cache, heads, scale) in the forward context, rotates q and k, writes this step's
keys and values into the cache and attends into output. Given o_weight and proj_out, it also
writes residual + output o_weight^T + o_bias into proj_out: at decode sizes on CUDA the
output projection shares the attention's launch (atom.kernels.triton_decode_o_proj).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from atom.compilation.custom_ops import direct_register_custom_op
from atom.cudagraph.region_graph import eager_region
from atom.kernels import tuning
from atom.kernels.paged_attention_torch import paged_attention_torch, write_kv_torch
from atom.kernels.rotary import Rope, apply_rotary
from atom.layers.linear import Linear
from atom.layers.norm_linear import project
from atom.layers.rotary import RotaryEmbedding
from atom.utils.forward_context import AttentionMetaData, get_forward_context, launch_rows


class Attention(nn.Module):
    """Holds one layer's KV cache; forward hands q/k/v to the registered op."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 layer_id: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_id = layer_id
        # Plain attributes, not buffers: the model runner allocates them after profiling,
        # and the forward never touches them (the op reads them through the forward context).
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        get_forward_context().no_compile_layers[layer_id] = self

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor | None = None,
                rotary: RotaryEmbedding | None = None, o_proj: Linear | None = None,
                residual: torch.Tensor | None = None, overlap: bool = False) -> torch.Tensor:
        """Attention over q, k, v ([T, heads * head_dim], strided views allowed). With
        positions and rotary, q and k are unrotated: the op rotates them (on CUDA inside the
        KV-store and attention kernels, so rotary costs no launch of its own). With o_proj
        (a Linear), the result is [residual +] o_proj(attention): at decode sizes on CUDA
        one launch does both. overlap: the kernel before (the producer of q, k and v) writes
        neither the cache, the step's metadata nor the parameters: the decode launch may start
        while it ends (atom.kernels.tuning.DECODE_PDL)."""
        output = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view
        cos, sin = (rotary.cos_cache, rotary.sin_cache) if rotary is not None else (None, None)
        if o_proj is None:
            torch.ops.aiter.unified_attention_with_output(q, k, v, output, self.layer_id,
                                                          positions, cos, sin, overlap=overlap)
            return output
        proj_out = torch.empty(q.shape[0], o_proj.weight.shape[0], dtype=q.dtype,
                               device=q.device)
        torch.ops.aiter.unified_attention_with_output(q, k, v, output, self.layer_id, positions,
                                                      cos, sin, o_proj.weight, o_proj.bias,
                                                      residual, proj_out, overlap)
        return proj_out


class OutputProjection(NamedTuple):
    """What the op writes after attending: out = [residual +] attention weight^T [+ bias]."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    residual: torch.Tensor | None
    out: torch.Tensor


# FUSED_DECODE_STORE and FUSED_DECODE_O_PROJ (atom.kernels.tuning) choose the decode launches.


def _attend(layer: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            output: torch.Tensor, meta: AttentionMetaData, rope: Rope | None,
            proj: OutputProjection | None, overlap: bool) -> bool:
    """Attention into output; True when proj was written too (the fused decode launch)."""
    slots, lens, tables = meta.slot_mapping, meta.context_lens, meta.block_tables
    # The runner fills these for every step that has a cache to attend to.
    assert slots is not None and lens is not None and tables is not None
    if q.is_cuda:
        from atom.kernels import triton_attention as tk
        from atom.kernels import triton_decode_o_proj as fused

        decode = meta.max_seqlen_q == 1 and meta.extra.get("decode", True)
        # Decode is one launch: rotary, the KV store and the split combine run in the kernel.
        fused_store = decode and tuning.FUSED_DECODE_STORE
        verify = _verify_splits(layer, meta) if decode else None
        if not fused_store or verify is not None:
            # A verify's rows read the keys of the rows before them (launched alongside): all
            # are stored first. The decode kernel still folds in its own key from registers,
            # as in plain decode, and stores it again (the same values).
            tk.store_kv_triton(k, v, layer.k_cache, layer.v_cache, slots, rope)
            overlap = overlap and verify is None  # the launch reads what the store wrote
        new_kv = tk.StepKV(k, v, slots) if fused_store else None
        if (fused_store and proj is not None and tuning.FUSED_DECODE_O_PROJ
                and launch_rows(q.shape[0]) == tuning.FUSED_O_PROJ_ROWS
                and q.shape[0] <= tuning.GEMV_MAX_ROWS):
            fused.decode_attention_o_proj_triton(
                q, layer.k_cache, layer.v_cache, output, lens, tables,
                layer.scale, layer.num_heads, proj.weight, proj.bias, proj.residual, proj.out,
                num_splits=verify, rope=rope, new_kv=new_kv, overlap=overlap)
            return True
        if decode:
            tk.decode_attention_triton(q, layer.k_cache, layer.v_cache, output, lens,
                                       tables, layer.scale, layer.num_heads,
                                       num_splits=verify, rope=rope, new_kv=new_kv,
                                       overlap=overlap and fused_store)
            return False
        if meta.num_rows < q.shape[0]:
            output[meta.num_rows:].zero_()  # padding rows belong to no sequence
        assert meta.cu_seqlens_q is not None  # a prefill step's row offsets
        tk.prefill_attention_triton(q, layer.k_cache, layer.v_cache, output, meta.cu_seqlens_q,
                                    lens, tables, layer.scale,
                                    layer.num_heads, meta.num_seqs, meta.max_seqlen_q, rope=rope,
                                    max_seqlen_k=meta.max_seqlen_k)
        return False
    if rope is not None:
        q = apply_rotary(q, rope.positions, rope.cos, rope.sin, layer.head_dim)
        k = apply_rotary(k, rope.positions, rope.cos, rope.sin, layer.head_dim)
    write_kv_torch(k, v, layer.k_cache, layer.v_cache, slots)
    assert meta.cu_seqlens_q is not None
    paged_attention_torch(q, layer.k_cache, layer.v_cache, output, meta.cu_seqlens_q,
                          lens, tables, layer.scale, layer.num_heads)
    return False


def _verify_splits(layer: Attention, meta: AttentionMetaData) -> int | None:
    """A verify step laid out as decode rows: the splits its requests' plain decode rows get
    (the split count sets the order each row's keys are summed in); None otherwise."""
    if meta.verify_rows <= 1:
        return None
    from atom.kernels import triton_attention as tk

    assert meta.block_tables is not None and meta.slot_mapping is not None  # as in _attend
    tiles = -(-meta.block_tables.shape[1] * layer.k_cache.shape[1] // tuning.DECODE_TILE_N)
    rows = launch_rows(meta.slot_mapping.shape[0])
    return tk.decode_num_splits(rows, layer.num_kv_heads, tiles)


def _launch_fixed_by_bucket() -> bool:
    """A pure decode step on CUDA: the store and split-K decode launches depend only on the
    padded rows and static shapes (never on context lengths), so a token graph records the
    op inline, as a request graph does, instead of breaking there. Prefill launches are
    sized by the step's sequences: those stay eager regions."""
    fctx = get_forward_context()
    meta = fctx.attn_metadata
    return (
        fctx.context is not None
        and not fctx.context.is_prefill  # a prefill recording must replay live prefill launches
        and isinstance(meta, AttentionMetaData)
        and meta.slot_mapping is not None
        and meta.slot_mapping.is_cuda
        and meta.max_seqlen_q == 1
        and bool(meta.extra.get("decode", True))
    )


@eager_region(inline_when=_launch_fixed_by_bucket)
def unified_attention_with_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  output: torch.Tensor, layer_id: int,
                                  positions: torch.Tensor | None = None,
                                  cos_cache: torch.Tensor | None = None,
                                  sin_cache: torch.Tensor | None = None,
                                  o_weight: torch.Tensor | None = None,
                                  o_bias: torch.Tensor | None = None,
                                  residual: torch.Tensor | None = None,
                                  proj_out: torch.Tensor | None = None,
                                  overlap: bool = False) -> None:
    """Store k, v in the layer's cache and attend into output; given positions and the cos/sin
    tables, q and k are rotated to their positions first. Given o_weight and proj_out:
    proj_out = [residual +] output o_weight^T [+ o_bias]. overlap: see Attention.forward."""
    if (o_weight is None) != (proj_out is None):
        raise ValueError("unified_attention_with_output: o_weight and proj_out go together "
                         f"(o_weight {'given' if o_weight is not None else 'missing'}, "
                         f"proj_out {'given' if proj_out is not None else 'missing'})")
    proj = (OutputProjection(o_weight, o_bias, residual, proj_out)
            if o_weight is not None and proj_out is not None else None)
    ctx = get_forward_context()
    layer = ctx.no_compile_layers[layer_id]
    meta = ctx.attn_metadata
    if isinstance(meta, dict):
        meta = meta[str(layer_id)] if str(layer_id) in meta else next(iter(meta.values()))
    if meta is None or layer.k_cache.numel() == 0:
        # No cache yet (shape tracing, or a forward outside the engine): nothing to attend to.
        output.zero_()
    else:
        rope = None
        if positions is not None:
            if cos_cache is None or sin_cache is None:
                raise ValueError("unified_attention_with_output: positions given without the "
                                 "rotary cos_cache and sin_cache")
            rope = Rope(positions, cos_cache, sin_cache)
        if _attend(layer, q, k, v, output, meta, rope, proj, overlap):
            return
    if proj is not None:
        # The kernel before is this op's own attention: it writes no parameter.
        project(output, proj.weight, proj.bias, residual=proj.residual, out=proj.out,
                overlap=True)


def unified_attention_with_output_fake(*args: object, **kwargs: object) -> None:
    """Shape propagation: the op returns nothing (it writes output and proj_out in place), so
    the fake takes the op's arguments whatever they are and does nothing."""
    return None


direct_register_custom_op(
    op_name="unified_attention_with_output",
    op_func=unified_attention_with_output,
    mutates_args=["output", "proj_out"],
    fake_impl=unified_attention_with_output_fake,
    dispatch_key=("CPU", "CUDA"),
)
