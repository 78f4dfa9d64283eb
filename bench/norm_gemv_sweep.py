"""The fused norm -> projection kernel (atom.kernels.triton_norm_gemv) against cuBLAS, by
variant and tile configuration, on the Llama-3.2-1B decode projections (issue 5).

Variants: plain (projection only), +norm, +norm+residual, and the gated MLP input; each timed
as 20 back-to-back calls in one CUDA graph (bench/gemv_sweep.py's method), per row count.

    python bench/norm_gemv_sweep.py --out sweep.json [--rows 1 8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv_sweep import time_graph  # noqa: E402

CONFIGS = {
    "qkv": [(32, 512, 4, 3), (32, 256, 4, 3), (16, 512, 4, 3), (64, 128, 4, 4)],
    "gate_up": [(32, 64, 4, 6), (64, 64, 4, 4), (32, 128, 4, 4), (16, 128, 4, 4)],
}


def main() -> None:
    import atom.kernels.triton_norm_gemv as kernels

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()
    hidden = 2048
    shapes = {"qkv": (3072, False), "gate_up": (2 * 8192, True)}
    default_config = kernels._config
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "rows": {}}
    for m in args.rows:
        x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
        res = torch.randn_like(x)
        nw = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        for name, (n, gated) in shapes.items():
            w = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16) * 0.02
            row: dict[str, Any] = {"cublas_us": round(time_graph(lambda x=x, w=w: F.linear(x, w)), 2)}
            variants = {"plain": (None, None), "norm": (None, nw), "norm+res": (res, nw)}
            for cfg in CONFIGS[name]:
                kernels._config = lambda *a, c=cfg: c  # noqa: E731 - the tile under test
                for vname, (r, norm_w) in variants.items():
                    try:
                        us = time_graph(lambda x=x, r=r, norm_w=norm_w, w=w, g=gated: kernels.norm_gemv(
                            x, r, norm_w, 1e-5, w, None, g))
                    except Exception as exc:  # noqa: BLE001 - too big for the SM: skip
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
