"""One-row gate_up (with its norm and gate) and down_proj (with its residual add): the TMA
kernel (atom.kernels.triton_tma_gemv) by plan against the tiled kernel (issue 5).

Each variant is timed as 20 back-to-back calls in one CUDA graph (bench/gemv_sweep.py's
method) over weight copies that overflow L2, launched early (programmatic dependent launch)
as the model launches them, and also as ordinary launches. Each TMA variant's output is
checked against the tiled kernel's first.

    python bench/tma_gemv_sweep.py --out tma.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from atom.kernels import triton_norm_gemv as kernels  # noqa: E402
from atom.kernels import triton_tma_gemv as tma  # noqa: E402
from gemv_sweep import time_graph  # noqa: E402

HIDDEN, FFN = 2048, 8192
# (rows a program, rows a tile, stages, warps); None: the default plan.
VARIANTS = {
    "gate_up": [None, (64, 32, 4, 8), (64, 32, 6, 4), (64, 16, 8, 4), (64, 64, 3, 8)],
    "down": [None, (16, 16, 6, 4), (16, 16, 16, 4), (16, 16, 12, 8)],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

    default_plan = tma.tma_plan
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "us": {}}
    for name in ("gate_up", "down"):
        gated = name == "gate_up"
        n, k = (2 * FFN, HIDDEN) if gated else (HIDDEN, FFN)
        x = randn(1, k)
        nw = 1 + randn(k, scale=0.1) if gated else None
        res = None if gated else randn(1, HIDDEN)
        ws = [randn(n, k, scale=k ** -0.5) for _ in range(max(2, (128 << 20) // (n * k * 2)))]
        turn = itertools.cycle(ws)

        def call(overlap: bool, weight: torch.Tensor | None = None) -> torch.Tensor:
            return kernels.gemv(x, weight if weight is not None else next(turn), None,
                                norm_weight=nw, eps=1e-5, gated=gated, residual=res,
                                overlap=overlap)

        tma.ENABLED = False
        reference = call(False, ws[0]).float()
        rows: dict[str, Any] = {}
        for overlap in (True, False):
            rows[f"tiled overlap={overlap}"] = round(time_graph(lambda o=overlap: call(o)), 2)
        tma.ENABLED = True
        for variant in VARIANTS[name]:
            if variant is None:
                tma.tma_plan = default_plan
                label = f"tma default {default_plan(n // 2 if gated else n, k, gated, 2, 132)}"
            else:
                r, t, s, w = variant
                programs = (n // 2 if gated else n) // r
                tma.tma_plan = lambda *a, p=tma.TmaPlan(programs, r, t, s, w), **kw: p
                label = f"tma rows {r} tile {t} stages {s} warps {w}"
            try:
                out = call(False, ws[0]).float()
                err = ((out - reference).abs().max() / reference.abs().max()).item()
                for overlap in (True, False):
                    rows[f"{label} overlap={overlap}"] = round(
                        time_graph(lambda o=overlap: call(o)), 2)
                rows[f"{label} rel_err_vs_tiled"] = round(err, 5)
            except Exception as exc:  # noqa: BLE001 - out of resources: recorded
                rows[label] = repr(exc)[:100]
            tma.tma_plan = default_plan
        result["us"][name] = rows
        print(name, json.dumps(rows, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
