"""Paged decode attention (atom.kernels.triton_attention) by split count, on the
Llama-3.2-1B attention shape (32 query heads, 8 kv heads, head_dim 64), issue 5.

For each batch and context, in a block table sized for a max_model_len, times one decode
attention call as 20 back-to-back calls in one CUDA graph (bench/common.py's time_graph), for
each split count and the launcher's own choice; beside the KV bytes over the measured copy
rate, for each variant in VARIANTS (what each launch includes).

    python bench/decode_attention_sweep.py --out attn.json [--batches 1 8 64]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from atom.models.registry import load_model_config
from common import copy_rate_bytes_per_s, time_graph

# The Llama-3.2-1B attention shape, from the model registry; the engine's block size.
_SHAPE = load_model_config("llama-3.2-1b")
HEADS, KV_HEADS, HEAD_DIM = (_SHAPE.num_attention_heads, _SHAPE.num_key_value_heads,
                             _SHAPE.head_dim)
BLOCK = 16
VARIANTS = {
    "store-first": "the KV-store kernel, then the decode kernel on keys rotated already",
    "decode-only": "the decode kernel alone (its split combine included)",
    "fused-norope": "one launch: this step's keys and values and the combine, no rotary",
    "fused": "the model's one launch: rotary, this step's keys and values, the combine",
}


def main() -> None:
    import atom.kernels.triton_attention as tk
    from atom.kernels import tuning
    from atom.kernels.testing import random_paged_batch
    from atom.layers.rotary import Rope, RotaryEmbedding

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--max-model-lens", type=int, nargs="+", default=[1536, 32768])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = ap.parse_args()
    rate = copy_rate_bytes_per_s()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_rate_Bps": rate,
                              "cases": []}
    for max_len in args.max_model_lens:
        width = max_len // BLOCK
        tiles = width * BLOCK // tuning.DECODE_TILE_N
        for ctx in [c for c in args.contexts if c < max_len]:
            for b in args.batches:
                batch = random_paged_batch([1] * b, [ctx] * b, HEADS, KV_HEADS, HEAD_DIM,
                                           num_blocks=b * (ctx // BLOCK + 1) + 1,
                                           max_blocks=width, dtype=torch.bfloat16,
                                           device="cuda")
                out = torch.empty_like(batch.q)
                table = RotaryEmbedding(HEAD_DIM, max_len, _SHAPE.rope_theta,
                                        _SHAPE.rope_scaling).cuda()
                positions = batch.context_lens.long() - 1
                rope = Rope(positions, table.cos_cache, table.sin_cache)
                kv_bytes = 2 * b * ctx * KV_HEADS * HEAD_DIM * 2
                row: dict[str, Any] = {"max_model_len": max_len, "context": ctx, "batch": b,
                                       "bound_us": round(kv_bytes / rate * 1e6, 2),
                                       "auto_splits": tk.decode_num_splits(b, KV_HEADS, tiles)}

                def call(variant: str, splits: int | None, bt: Any = batch, o: Any = out,
                         rope: Rope = rope) -> None:
                    if variant == "store-first":
                        tk.store_kv_triton(bt.k, bt.v, bt.k_cache, bt.v_cache, bt.slot_mapping)
                    fused = variant.startswith("fused")
                    tk.decode_attention_triton(
                        bt.q, bt.k_cache, bt.v_cache, o, bt.context_lens, bt.block_tables,
                        HEAD_DIM ** -0.5, HEADS, num_splits=splits,
                        rope=rope if variant == "fused" else None,
                        new_kv=tk.StepKV(bt.k, bt.v, bt.slot_mapping) if fused else None)

                for variant in args.variants:
                    for splits in [None, *args.splits]:
                        us = time_graph(lambda v=variant, s=splits: call(v, s))
                        key = "auto" if splits is None else str(splits)
                        row[f"{variant} {key}"] = round(us, 2)
                result["cases"].append(row)
                print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
