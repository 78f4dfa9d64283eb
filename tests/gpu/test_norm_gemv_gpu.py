"""The fused decode projections on CUDA in bf16 (aiter::norm_linear, aiter::linear_add),
against the model's unfused torch math computed in fp32, on the Llama-3.2-1B projection
shapes, on both sides of the fused kernel's row limit; and inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

import atom.layers.norm_linear  # noqa: F401 - registers the ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]

HIDDEN, QKV, FFN = 2048, 3072, 8192


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # bf16 rounding of the dot's inputs and of the output: about 1% of the output scale.
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 64, 300])
@pytest.mark.parametrize(("gated", "bias"), [(False, False), (False, True), (True, False)])
def test_norm_linear_matches_unfused_math(rows: int, gated: bool, bias: bool) -> None:
    from atom.layers.norm_linear import reference_projection

    gen = torch.Generator(device="cuda").manual_seed(rows)
    n = 2 * FFN if gated else QKV
    x, norm_w = _randn(gen, rows, HIDDEN), 1 + _randn(gen, HIDDEN, scale=0.1)
    w, b = _randn(gen, n, HIDDEN, scale=HIDDEN ** -0.5), _randn(gen, n) if bias else None
    out = torch.ops.aiter.norm_linear(x, norm_w, 1e-5, w, b, gated)
    ref = reference_projection(x.float(), w.float(), b.float() if bias else None,
                               norm_weight=norm_w.float(), eps=1e-5, gated=gated)
    _close(out, ref)


@pytest.mark.parametrize("rows", [1, 8, 16, 17, 300])
@pytest.mark.parametrize(("k", "bias"), [(HIDDEN, False), (FFN, True)])
def test_linear_add_matches_unfused_math(rows: int, k: int, bias: bool) -> None:
    from atom.layers.norm_linear import reference_projection

    gen = torch.Generator(device="cuda").manual_seed(rows + k)
    x, res = _randn(gen, rows, k), _randn(gen, rows, HIDDEN)
    w, b = _randn(gen, HIDDEN, k, scale=k ** -0.5), _randn(gen, HIDDEN) if bias else None
    out = torch.ops.aiter.linear_add(x, w, b, res)
    ref = reference_projection(x.float(), w.float(), b.float() if bias else None,
                               residual=res.float())
    _close(out, ref)


@pytest.mark.parametrize("rows", [1, 8, 16, 17])
def test_logits_projection_matches_cublas(rows: int) -> None:
    """The vocabulary-sized projection (compute_logits at decode sizes: the kernel's own tile
    for vocabulary rows), against cuBLAS in fp32, with a row count on each side of the limit;
    an odd vocabulary leaves the last strip partial."""
    from atom.layers.norm_linear import project

    gen = torch.Generator(device="cuda").manual_seed(rows)
    vocab = 128256 + 5
    x, w = _randn(gen, rows, HIDDEN), _randn(gen, vocab, HIDDEN, scale=HIDDEN ** -0.5)
    _close(project(x, w, None), x.float() @ w.float().t())


@pytest.mark.parametrize("op", ["norm_linear", "norm_linear_gated", "linear_add"])
def test_replays_in_a_cuda_graph(op: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = _randn(gen, 4, HIDDEN)
    norm_w = 1 + _randn(gen, HIDDEN, scale=0.1)
    res = _randn(gen, 4, HIDDEN)
    n = 2 * FFN if op == "norm_linear_gated" else (HIDDEN if op == "linear_add" else QKV)
    w = _randn(gen, n, HIDDEN, scale=HIDDEN ** -0.5)

    def call() -> torch.Tensor:
        if op == "linear_add":
            return torch.ops.aiter.linear_add(x, w, None, res)
        return torch.ops.aiter.norm_linear(x, norm_w, 1e-5, w, None, op.endswith("gated"))

    before = call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    x.copy_(torch.randn_like(x))  # new inputs at the recorded addresses
    graph.replay()
    assert torch.equal(out, call()) and not torch.equal(out, before)


@pytest.mark.parametrize("rows", [1, 2, 8, 16])
@pytest.mark.parametrize("shape", ["qkv", "o", "gate_up", "down"])
def test_early_launches_give_the_ordinary_launchs_bits(rows: int, shape: str) -> None:
    """A projection launched early (overlap: on sm_90 one-wave strips, fewer rows a program
    where that covers more SMs, down_proj's first weight tile loaded before the wait) sums the
    same products in the same order as the ordinary launch: bit-identical, and close to the
    reference. One row of qkv or o goes to the preloading kernel instead (its own test)."""
    from atom.kernels.triton_norm_gemv import gemv
    from atom.layers.norm_linear import reference_projection

    n, k, gated = {"qkv": (QKV, HIDDEN, False), "o": (HIDDEN, HIDDEN, False),
                   "gate_up": (2 * FFN, HIDDEN, True), "down": (HIDDEN, FFN, False)}[shape]
    if rows == 1 and shape in ("qkv", "o"):
        pytest.skip("one row of a 2048-wide projection runs the preloading kernel")
    gen = torch.Generator(device="cuda").manual_seed(rows + n + k)
    x, w = _randn(gen, rows, k), _randn(gen, n, k, scale=k ** -0.5)
    norm_w = 1 + _randn(gen, k, scale=0.1) if shape in ("qkv", "gate_up") else None
    res = _randn(gen, rows, n) if shape in ("o", "down") else None
    kwargs = dict(norm_weight=norm_w, eps=1e-5, gated=gated, residual=res)
    ordinary = gemv(x, w, None, **kwargs)
    early = gemv(x, w, None, overlap=True, **kwargs)
    assert torch.equal(early, ordinary)
    ref = reference_projection(x.float(), w.float(), None,
                               norm_weight=None if norm_w is None else norm_w.float(), eps=1e-5,
                               gated=gated, residual=None if res is None else res.float())
    _close(early, ref)


@pytest.mark.parametrize("shape", [(1, HIDDEN), (300, HIDDEN), (5, 8, 128)])
def test_rms_norm_op_matches_the_torch_math(shape: tuple[int, ...]) -> None:
    """The model's RMSNorm on CUDA (the final norm; per-head q/k norms on a strided view of
    the qkv rows) runs aiter::rms_norm, one kernel and no copy: within a rounding step of the
    torch math, in the input's shape and dtype."""
    from torch.profiler import ProfilerActivity, profile

    from atom.layers.rmsnorm import RMSNorm, rms_norm

    gen = torch.Generator(device="cuda").manual_seed(len(shape))
    dim = shape[-1]
    norm = RMSNorm(dim, 1e-5).cuda().bfloat16()
    norm.weight.data = 1 + _randn(gen, dim, scale=0.1)
    wide = _randn(gen, *shape[:-1], 3 * dim)
    x = wide[..., dim:2 * dim]  # a strided view, as q/k out of the qkv projection
    norm(x)  # compiled outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = norm(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels == ["_rmsnorm_kernel"], kernels
    ref = rms_norm(x, norm.weight, 1e-5)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
