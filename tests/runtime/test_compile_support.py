"""Toy models and a fresh-process worker for the compilation tests and bench/compile_bench.py.

The split op `aiter.toy_affine(x, out)` writes out = 3x + 19 and counts its calls, so a
model's output has a closed form: ClosedFormModel(L layers)(x) == x * 6**L.

Run as a script it builds a model in a fresh process, runs it over a few batch sizes and
prints one JSON line (counter deltas, cache dir, whether outputs matched, timings).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

from atom.compilation.custom_ops import direct_register_custom_op
from atom.compilation.decorators import support_torch_compile
from atom.config import CompilationConfig, Config

SPLIT_OP = "aiter.toy_affine"
split_calls = {"n": 0}


def _toy_affine(x: torch.Tensor, out: torch.Tensor) -> None:
    split_calls["n"] += 1
    out.copy_(3 * x + 19)


def _toy_affine_fake(x: torch.Tensor, out: torch.Tensor) -> None:
    return None


if not hasattr(torch.ops.aiter, "toy_affine"):
    direct_register_custom_op(
        "toy_affine", _toy_affine, mutates_args=["out"], fake_impl=_toy_affine_fake, dispatch_key=("CPU", "CUDA")
    )


def speed_up_cpu_inductor() -> None:
    """Test-only: Inductor on CPU probes each vector ISA by starting a Python that imports
    torch (seconds each, once per process). Keep the compile check, skip the slow load
    probe. GPU runs and the product are unaffected."""
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.VecISA._avx_py_load = "import sys\n"


def share_inductor_cache_for_tests() -> None:
    """In-process tests: one Inductor kernel cache for all tests (each test has its own
    compile-cache dir, which would otherwise get its own kernel cache and rebuild them)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "torchinductor_atom_tests"))


@support_torch_compile
class ClosedFormModel(nn.Module):
    """Per layer: h*2 (piece) -> 3h+19 (split op) -> -19 (piece): the output is x * 6**L."""

    def __init__(self, *, atom_config: Config, num_layers: int = 2) -> None:
        super().__init__()
        self.num_layers = num_layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for _ in range(self.num_layers):
            h = h * 2
            out = torch.empty_like(h)
            torch.ops.aiter.toy_affine(h, out)
            h = out - 19
        return h


@support_torch_compile
class RandomToyModel(nn.Module):
    """Llama-shaped toy: (input_ids[T], positions[T]) -> hidden[T, H], one split op per layer."""

    def __init__(self, *, atom_config: Config, num_layers: int = 2, hidden: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(256, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            h = torch.nn.functional.silu(layer(h)) + h
            out = torch.empty_like(h)
            torch.ops.aiter.toy_affine(h, out)
            h = out * 0.01
        return self.norm(h)


def make_config(level: int, cache_dir: str = "", **cc: Any) -> Config:
    cc.setdefault("splitting_ops", [SPLIT_OP])
    return Config(
        model="toy",
        dtype="float32",
        max_num_seqs=64,
        compilation_config=CompilationConfig(level=level, cache_dir=cache_dir, **cc),
    )


def random_inputs(bs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + bs)
    return torch.randint(0, 64, (bs,), generator=g), torch.randint(0, 256, (bs,), generator=g)


def build_random(level: int, cache_dir: str = "", num_layers: int = 2, **cc: Any) -> RandomToyModel:
    torch.manual_seed(0)  # same weights in every process
    return RandomToyModel(atom_config=make_config(level, cache_dir, **cc), num_layers=num_layers)


def test_closed_form_eager_matches_formula() -> None:
    model = ClosedFormModel(atom_config=make_config(0), num_layers=3)
    x = torch.randn(5, 4)
    before = split_calls["n"]
    torch.testing.assert_close(model(x), x * 6**3, rtol=1e-5, atol=1e-3)
    assert split_calls["n"] - before == 3


def test_random_model_level0_is_plain_eager() -> None:
    from atom.utils.counters import counters

    model = build_random(0)
    ids, pos = random_inputs(4)
    assert model.do_not_compile
    with counters.track() as delta:
        out = model(ids, pos)
    torch.testing.assert_close(out, type(model).forward(model, ids, pos))
    assert "graphs_compiled" not in delta


def worker_main(argv: list[str]) -> None:
    from atom.utils.counters import counters

    ap = argparse.ArgumentParser()
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--level", type=int, default=3)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--sizes", default="3,5")
    ap.add_argument("--compile-sizes", default="")
    ap.add_argument("--fast-isa", action="store_true")
    args = ap.parse_args(argv)
    if args.fast_isa:
        speed_up_cpu_inductor()
    t0 = time.perf_counter()
    cc: dict[str, Any] = {}
    if args.compile_sizes:
        cc["compile_sizes"] = [int(s) for s in args.compile_sizes.split(",")]
    model = build_random(args.level, args.cache_dir, num_layers=args.layers, **cc)
    eager = build_random(0, num_layers=args.layers)
    ok = True
    first_call_s = None
    with counters.track() as delta:
        for bs in [int(s) for s in args.sizes.split(",")]:
            ids, pos = random_inputs(bs)
            t = time.perf_counter()
            out = model(ids, pos)
            if first_call_s is None:
                first_call_s = time.perf_counter() - t
            ok = ok and torch.allclose(out, eager(ids, pos), rtol=1e-4, atol=1e-4)
    print(
        json.dumps(
            {
                "counters": delta,
                "local_cache_dir": model.atom_config.compilation_config.local_cache_dir,
                "ok": bool(ok),
                "first_call_s": first_call_s,
                "total_s": time.perf_counter() - t0,
                "pid": os.getpid(),
            }
        )
    )


if __name__ == "__main__":
    worker_main(sys.argv[1:])
