"""The fused norm -> projection kernel (atom.kernels.triton_norm_gemv) against cuBLAS, by
variant and tile configuration, on the Llama-3.2-1B decode projections (issue 5).

Tiles: each projection (qkv and gate_up plain and with the norm, o and down with the
residual) per tile configuration, timed as 20 back-to-back calls in one CUDA graph
(bench/common.py's time_graph) over weight copies that overflow L2, per row count.
Chain: the four projections of 16 decoder layers (qkv with its norm, o_proj + residual,
gate_up with norm and gate, down_proj + residual) in one graph, as a decode step runs them,
with the default tiles and with the same tiles on one accumulator (no K split); per layer,
beside the layer's weight bytes over the measured copy rate.

Logits (--lm-head): the vocabulary projection (tied embeddings) by cuBLAS, as the engine
runs it, against the tiled kernel per tile configuration, plain and with the final norm.

    python bench/norm_gemv_sweep.py --out sweep.json [--rows 1 8] [--skip-tiles] [--lm-head]
        [--only gate_up ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from atom.models.registry import load_model_config
from common import MODEL, copy_rate_bytes_per_s, projection_shapes, record_graph, time_graph

# (BLOCK_N, BLOCK_K, warps, stages, SPLIT): SPLIT 1 is one accumulator chain per strip.
CONFIGS = {
    "qkv": [(32, 512, 4, 3, 1), (32, 512, 4, 3, 4), (32, 256, 4, 4, 4), (16, 512, 4, 3, 4),
            (32, 512, 8, 3, 8)],
    "gate_up": [(32, 64, 4, 6, 1), (64, 64, 4, 4, 1), (32, 128, 4, 4, 1), (16, 128, 4, 6, 1),
                (32, 64, 4, 6, 4),
                # longer K steps (a weight row's 512 B to 2 KB at a time), K in slices
                (32, 128, 4, 6, 2), (32, 256, 4, 4, 4), (16, 256, 4, 6, 4), (16, 512, 4, 3, 4),
                (32, 512, 8, 3, 8), (64, 256, 8, 3, 8), (16, 1024, 4, 2, 4), (16, 1024, 8, 3, 8)],
    "o": [(16, 512, 4, 3, 1), (16, 512, 4, 3, 4), (16, 1024, 4, 3, 4), (16, 512, 8, 3, 8),
          (16, 256, 4, 6, 4)],
    "down": [(16, 512, 4, 3, 1), (16, 512, 4, 3, 4), (16, 1024, 4, 3, 4), (16, 1024, 8, 3, 8),
             (16, 512, 8, 4, 8)],
    "lm_head": [(32, 256, 4, 4, 4), (64, 256, 4, 4, 4), (64, 128, 4, 6, 1), (128, 128, 8, 3, 1),
                (32, 512, 4, 3, 4), (16, 256, 4, 6, 4), (64, 512, 8, 3, 8)],
}


# The shape decode_bench runs (Llama-3.2-1B), from the model registry.
_CONFIG = load_model_config(MODEL)
SHAPES = projection_shapes(_CONFIG)  # name -> (weight rows, K)
HIDDEN, LAYERS = _CONFIG.hidden_size, _CONFIG.num_hidden_layers
VOCAB = _CONFIG.vocab_size
Q = SHAPES["o"][1]  # o_proj reads the query heads


def _layer_weights() -> list[dict[str, torch.Tensor]]:
    ones = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    return [{**{name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                for name, (n, k) in SHAPES.items()}, "norm": ones} for _ in range(LAYERS)]


def _chain(kernels: Any, layers: list[dict[str, torch.Tensor]], hidden: torch.Tensor) -> None:
    """The decode step's projections, layer after layer (attention left out: o_proj reads
    the q part of qkv), writing the final residual stream back into `hidden`."""
    h = hidden
    for lw in layers:
        qkv = kernels.gemv(h, lw["qkv"], None, norm_weight=lw["norm"], eps=1e-5)
        h = kernels.gemv(qkv[:, :Q], lw["o"], None, residual=h)
        act = kernels.gemv(h, lw["gate_up"], None, norm_weight=lw["norm"], eps=1e-5, gated=True)
        h = kernels.gemv(act, lw["down"], None, residual=h)
    hidden.copy_(h)


def _time_chain(fn: Any, replays: int = 20, repeats: int = 7) -> float:
    """Median microseconds of one replay of fn recorded in a CUDA graph."""
    g = record_graph(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(samples)


def chain(kernels: Any, rows: list[int]) -> dict[str, Any]:
    layers = _layer_weights()
    layer_bytes = sum(t.numel() * t.element_size() for t in layers[0].values())
    rate = copy_rate_bytes_per_s()
    out: dict[str, Any] = {"layer_bytes": layer_bytes, "copy_rate_Bps": rate,
                           "bound_us_per_layer": round(layer_bytes / rate * 1e6, 2), "rows": {}}
    default_config = kernels._config

    def single_accumulator(n: int, k: int, gated: bool, *rest: Any, **kw: Any
                           ) -> tuple[int, ...]:
        return (*default_config(n, k, gated, *rest, **kw)[:4], 1)

    variants = {"single accumulator": single_accumulator, "split K (default)": default_config}
    for m in rows:
        hidden = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        per: dict[str, float] = {}
        results = {}
        for name, config in variants.items():
            kernels._config = config
            start = hidden.clone()
            us = _time_chain(lambda s=start: _chain(kernels, layers, s))
            per[name] = round(us / LAYERS, 2)
            work = hidden.clone()
            _chain(kernels, layers, work)  # an eager pass from the same input, to compare
            results[name] = work
        kernels._config = default_config
        a, b = results.values()
        per["max_abs_diff"] = float((a.float() - b.float()).abs().max())
        out["rows"][str(m)] = per
        print(f"chain m={m}: us/layer {per} (bound {out['bound_us_per_layer']})", flush=True)
    return out


def main() -> None:
    import atom.kernels.triton_norm_gemv as kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--skip-tiles", action="store_true", help="only the 16-layer chain")
    ap.add_argument("--lm-head", action="store_true",
                    help="also the logits' projection, cuBLAS against the tiled kernel")
    ap.add_argument("--only", nargs="+", choices=sorted(CONFIGS),
                    help="time these projections' tiles only")
    args = ap.parse_args()
    # name: variants; o and down carry the residual add.
    variant_names = {"qkv": ("plain", "norm"), "gate_up": ("plain", "norm"), "o": ("res",),
                     "down": ("res",)}
    default_config = kernels._config
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": {},
                              "chain": chain(kernels, args.rows)}
    shapes = {**({} if args.skip_tiles else SHAPES),
              **({"lm_head": (VOCAB, HIDDEN)} if args.lm_head else {})}
    if args.only:
        shapes = {name: shape for name, shape in shapes.items() if name in args.only}
    variant_names["lm_head"] = ("plain", "norm")
    for m in args.rows if shapes else []:
        res = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)
        for name, (n, k) in shapes.items():
            gated, vnames = name == "gate_up", variant_names[name]
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
            # Copies enough to overflow L2: no call finds its weights left there by the last.
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                  for _ in range(max(2, (128 << 20) // (n * k * 2)))]
            turn = itertools.cycle(ws)
            row: dict[str, Any] = {"cublas_us": round(time_graph(
                lambda x=x, t=turn: F.linear(x, next(t))), 2)}
            variants = {"plain": (None, None), "norm": (None, nw), "res": (res, None)}
            for cfg in CONFIGS[name]:
                kernels._config = lambda *a, c=cfg, **kw: c  # noqa: E731 - the tile under test
                for vname in vnames:
                    r, norm_w = variants[vname]
                    try:
                        us = time_graph(lambda x=x, r=r, norm_w=norm_w, t=turn, g=gated:
                                        kernels.gemv(x, next(t), None, norm_weight=norm_w,
                                                     eps=1e-5, gated=g, residual=r))
                    except OutOfResources as exc:  # a tile too big for the SM: skip it
                        us = None
                        print(f"  {name} m={m} {cfg} {vname}: {type(exc).__name__}")
                    row[f"{vname} {cfg}"] = round(us, 2) if us else None
            kernels._config = default_config
            result["rows"].setdefault(str(m), {})[name] = row
            print(f"m={m} {name}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
