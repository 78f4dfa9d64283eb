"""The decoder MLP at one row, 16 layers back to back in one CUDA graph (issue 5): the
one-launch kernel (atom.kernels.triton_decode_mlp) per setting against the two launches it
replaces, us per layer beside the MLP's weight bytes over the measured copy rate.

    python bench/decode_mlp_sweep.py --out mlp.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import atom.layers.norm_linear  # noqa: E402,F401 - registers the ops
from atom.models.registry import load_model_config  # noqa: E402
from decode_bench import MODEL, copy_rate_bytes_per_s  # noqa: E402
from norm_gemv_sweep import _time_chain  # noqa: E402
from profile_decode import alternative  # noqa: E402

# name -> profile_decode ALTERNATIVES entry (None: the defaults)
VARIANTS = ["mlp-two-launches", None, "mlp-preload", "mlp-down-k512", "mlp-8-warps",
            "mlp-smem-150k"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", nargs="+", default=VARIANTS)
    args = ap.parse_args()
    c = load_model_config(MODEL)
    hidden, inter, layers = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    weights = [(1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16() for _ in range(layers)]
    gate_up = [(torch.randn(2 * inter, hidden, device="cuda") * hidden ** -0.5).bfloat16()
               for _ in range(layers)]
    down = [(torch.randn(hidden, inter, device="cuda") * inter ** -0.5).bfloat16()
            for _ in range(layers)]
    layer_bytes = 2 * (3 * inter * hidden + hidden)
    rate = copy_rate_bytes_per_s()
    hidden_in = torch.randn(1, hidden, device="cuda").bfloat16()

    def chain(h: torch.Tensor) -> None:
        x = h
        for nw, gu, dn in zip(weights, gate_up, down, strict=True):
            x = torch.ops.aiter.norm_mlp(x, nw, 1e-5, gu, None, dn, None, x, True)
        h.copy_(x)

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_rate_Bps": rate,
                              "bound_us_per_layer": round(layer_bytes / rate * 1e6, 2),
                              "us_per_layer": {}}
    outputs = {}
    for name in args.variants:
        with alternative(name):
            start = hidden_in.clone()
            us = _time_chain(lambda s=start: chain(s))
            work = hidden_in.clone()
            chain(work)
            outputs[name] = work
        result["us_per_layer"][name or "default"] = round(us / layers, 2)
        print(f"{name or 'default'}: {us / layers:.2f} us/layer "
              f"(bound {result['bound_us_per_layer']})", flush=True)
    first = next(iter(outputs.values()))
    result["bit_identical"] = all(torch.equal(first, o) for o in outputs.values())
    print("bit-identical across variants:", result["bit_identical"])
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
