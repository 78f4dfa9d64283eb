"""A decoder layer's projections with their neighbours, as ops:

- `aiter::norm_linear`: RMSNorm then a projection (then SiLU(gate) * up for the MLP input);
- `aiter::linear_add`: a projection plus the residual stream (o_proj, down_proj), which is
  how the residual is carried: each layer's output projection writes the new stream.

Both are opaque to Dynamo, like the attention op: every compilation level and graph mode runs
the same implementation, so they produce the same tokens. On CUDA they run the fused Triton
kernels (atom.kernels.triton_norm_gemv: one kernel per projection at decode sizes);
elsewhere the model's plain torch math, so CPU numerics are those of the unfused model.
"""

from __future__ import annotations

from typing import TypedDict, Unpack

import torch
import torch.nn.functional as F

from atom.compilation.custom_ops import direct_register_custom_op
from atom.kernels import tuning
from atom.layers.rmsnorm import rms_norm
from atom.utils.forward_context import launch_rows


def reference_projection(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                         norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                         gated: bool = False, residual: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """The unfused math: RMSNorm in fp32 as Hugging Face does, the projection, SiLU(gate) * up,
    the residual add in the model's dtype."""
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)
    out = F.linear(x, weight, bias)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out + residual if residual is not None else out


class Fused(TypedDict, total=False):
    """reference_projection's keywords: the neighbours fused into a projection."""

    norm_weight: torch.Tensor | None
    eps: float
    gated: bool
    residual: torch.Tensor | None


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
            out: torch.Tensor | None = None, overlap: bool = False,
            **fused: Unpack[Fused]) -> torch.Tensor:
    """The projection with its fused neighbours (reference_projection's keywords), into out
    when given: the decode kernels on CUDA, the unfused math elsewhere. overlap: the kernel
    before writes none of the parameters (triton_norm_gemv.gemv)."""
    if x.is_cuda:
        from atom.kernels import triton_norm_gemv as kernels

        # A verify step's rows launch as its requests' decode rows would (launch_rows).
        plan = launch_rows(x.shape[0])
        if plan <= tuning.GEMV_MAX_ROWS:
            return kernels.gemv(x, weight, bias, out=out, overlap=overlap, plan_rows=plan,
                                **fused)
        return kernels.rows_path(x, weight, bias, out=out, **fused)
    result = reference_projection(x, weight, bias, **fused)
    return result if out is None else out.copy_(result)


def _norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                 bias: torch.Tensor | None, gated: bool, overlap: bool = False) -> torch.Tensor:
    return project(x, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated,
                   overlap=overlap)


def _norm_linear_fake(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None, gated: bool,
                      overlap: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0])


def _linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor | None, overlap: bool = False) -> torch.Tensor:
    return project(x, weight, bias, residual=residual, overlap=overlap)


def _linear_add_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     residual: torch.Tensor | None, overlap: bool = False) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


direct_register_custom_op("norm_linear", _norm_linear, fake_impl=_norm_linear_fake,
                          dispatch_key=("CPU", "CUDA"))
direct_register_custom_op("linear_add", _linear_add, fake_impl=_linear_add_fake,
                          dispatch_key=("CPU", "CUDA"))


def norm_linear(x: torch.Tensor, norm: torch.nn.Module, proj: torch.nn.Module,
                gated: bool = False, overlap: bool = False) -> torch.Tensor:
    """proj(norm(x)); gated: proj is a merged gate/up projection, the result SiLU(gate) * up.
    norm: an RMSNorm (weight, eps); proj: a Linear (weight, bias). overlap: the kernel before
    writes none of the parameters (a model's forward), so the launch may start early."""
    return torch.ops.aiter.norm_linear(x, norm.weight, norm.eps, proj.weight, proj.bias, gated,
                                       overlap)


def linear_add(x: torch.Tensor, proj: torch.nn.Module, residual: torch.Tensor | None,
               overlap: bool = False) -> torch.Tensor:
    """residual + proj(x): the residual stream after an output projection (overlap: as for
    norm_linear). residual None: proj(x) alone (a row-parallel rank other than 0, whose
    partial sum must not carry the stream a second time)."""
    return torch.ops.aiter.linear_add(x, proj.weight, proj.bias, residual, overlap)
