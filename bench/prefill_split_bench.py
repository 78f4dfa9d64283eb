"""Prefill attention of a short chunk over a long cached context (issue 29): the tiled prefill
kernel against the split-KV kernel (atom.kernels.triton_prefill_split), on the Llama-3.2-1B
attention shape (32 query heads, 8 kv heads, head_dim 64, bf16, cache blocks of 16).

The prefix-cache repeat of a 4,096-token prompt prefills its last 16 tokens over 4,080 cached
ones: one such call per layer. A case times all the model's layers' worth (16 calls, each
layer's own cache, 134 MB together, so a layer's keys are not in L2 from the one before) two
ways: eagerly as prefill runs (launches included: the median wall time of the 16 calls and a
synchronize) and replayed from a CUDA graph (device time). The split kernel at the launcher's
own split count ("auto") and at each of --splits; "max_diff" is the largest difference of its
output from the tiled kernel's.

    PYTHONPATH=runtime:operator python bench/prefill_split_bench.py [--out split.json]
    # the issue's case only
    PYTHONPATH=runtime:operator python bench/prefill_split_bench.py --rows 16 --contexts 4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from atom.models.registry import load_model_config
from common import sync, time_graph

_SHAPE = load_model_config("llama-3.2-1b")
HEADS, KV_HEADS, HEAD_DIM = (
    _SHAPE.num_attention_heads,
    _SHAPE.num_key_value_heads,
    _SHAPE.head_dim,
)
LAYERS = _SHAPE.num_hidden_layers
BLOCK = 16


def eager_us(fn: Any, reps: int) -> float:
    """Median wall microseconds of fn() and a synchronize (fn run once first: compiled)."""
    fn()
    sync()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def run_case(rows: int, ctx: int, args: argparse.Namespace) -> dict[str, Any]:
    """One chunk of `rows` over a context of `ctx` tokens, every layer's worth: see the module."""
    import atom.kernels.triton_attention as tk
    import atom.kernels.triton_prefill_split as split_kv
    from atom.kernels.testing import random_paged_batch

    b = random_paged_batch(
        [rows],
        [ctx],
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        num_blocks=ctx // BLOCK + 1,
        max_blocks=args.max_model_len // BLOCK,
        dtype=torch.bfloat16,
        device="cuda",
    )
    caches = [(torch.randn_like(b.k_cache), torch.randn_like(b.v_cache)) for _ in range(LAYERS)]
    out = torch.empty_like(b.q)

    def attend(kc: torch.Tensor, vc: torch.Tensor, o: torch.Tensor, splits: int | None) -> None:
        tk.prefill_attention_triton(
            b.q,
            kc,
            vc,
            o,
            b.cu_seqlens_q,
            b.context_lens,
            b.block_tables,
            HEAD_DIM**-0.5,
            HEADS,
            1,
            rows,
            max_seqlen_k=ctx,
            num_splits=splits,
        )

    def layers(splits: int | None) -> None:
        for kc, vc in caches:
            attend(kc, vc, out, splits)

    def diff(splits: int | None) -> float:
        """Largest difference of layer 0's output from the tiled kernel's."""
        o, tiled = torch.empty_like(b.q), torch.empty_like(b.q)
        attend(*caches[0], o, splits)
        attend(*caches[0], tiled, 1)
        return float((o.float() - tiled.float()).abs().max())

    auto = split_kv.prefill_num_splits(1, rows, ctx, HEADS, KV_HEADS, HEAD_DIM, torch.bfloat16)
    row: dict[str, Any] = {"rows": rows, "context": ctx, "auto_splits": auto}
    for key, splits in [("tiled", 1), ("auto", None)]:
        row[f"{key}_eager_us"] = round(eager_us(lambda s=splits: layers(s), args.reps), 1)
        row[f"{key}_graph_us"] = round(time_graph(lambda s=splits: layers(s)), 1)
    row["auto_max_diff"] = diff(None)
    for splits in args.splits:
        row[f"split{splits}_graph_us"] = round(time_graph(lambda s=splits: layers(s)), 1)
        row[f"split{splits}_max_diff"] = diff(splits)
    row["eager_speedup"] = round(row["tiled_eager_us"] / row["auto_eager_us"], 2)
    row["graph_speedup"] = round(row["tiled_graph_us"] / row["auto_graph_us"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64], help="chunk rows")
    ap.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[512, 1024, 2048, 4096],
        help="context lengths (the chunk's rows included)",
    )
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    ap.add_argument("--max-model-len", type=int, default=8192, help="block-table width")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "layers": LAYERS,
        "shape": [HEADS, KV_HEADS, HEAD_DIM],
        "cases": [],
    }
    for ctx in args.contexts:
        for rows in [r for r in args.rows if r <= ctx]:
            row = run_case(rows, ctx, args)
            result["cases"].append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    for row in result["cases"]:
        print(
            f"rows {row['rows']:3d} context {row['context']:5d}: {LAYERS} layers tiled "
            f"{row['tiled_eager_us']:9.1f} us eager / {row['tiled_graph_us']:9.1f} graph, "
            f"split x{row['auto_splits']} {row['auto_eager_us']:8.1f} eager / "
            f"{row['auto_graph_us']:8.1f} graph ({row['eager_speedup']}x eager, "
            f"{row['graph_speedup']}x graph)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
