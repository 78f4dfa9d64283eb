"""A decoder layer's projections in FP8, as ops the model calls in place of the bf16 ones:

- `aiter::fp8_norm_linear`: RMSNorm, then the FP8 projection (then SiLU(gate) * up);
- `aiter::fp8_linear_add`: the FP8 projection plus the residual stream.

Like atom.layers.norm_linear's ops they are opaque to Dynamo, so every compilation level and
graph mode runs the same implementation. The weights live in `Fp8Weights` modules beside the
bf16 layers (Fp8Projections, one per decoder layer): the checkpoint loads into the bf16 layers
as ever, then `quantize_model` fills the FP8 weights and frees the bf16 ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from atom.compilation.custom_ops import direct_register_custom_op
from atom.layers.rmsnorm import RMSNorm, rms_norm
from atom.quantization.fp8 import FP8_DTYPE, fp8_linear, quantize_weight


class Fp8Weights(nn.Module):
    """One projection's weight [out, in] in float8_e4m3fn and its per-output-channel scales."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, out_features: int, in_features: int,
                 device: torch.device | None = None) -> None:
        super().__init__()
        # Buffers, not parameters: what is drawn or loaded is the bf16 weight they come from.
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE,
                                                   device=device))
        self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32,
                                                 device=device))

    @classmethod
    def like(cls, weight: torch.Tensor) -> Fp8Weights:
        """Empty FP8 weights of weight's shape, on its device."""
        return cls(weight.shape[0], weight.shape[1], weight.device)

    @torch.no_grad()
    def quantize_from(self, weight: torch.Tensor) -> None:
        q, scale = quantize_weight(weight)
        self.weight.copy_(q)
        self.scale.copy_(scale)


class Fp8Projections(nn.Module):
    """A decoder layer's four projections in FP8 (their biases stay on the bf16 layers)."""

    def __init__(self, qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor) -> None:
        super().__init__()
        self.qkv, self.o = Fp8Weights.like(qkv), Fp8Weights.like(o)
        self.gate_up, self.down = Fp8Weights.like(gate_up), Fp8Weights.like(down)

    def pairs(self, sources: tuple[nn.Parameter, ...]) -> Iterable[tuple[Fp8Weights, nn.Parameter]]:
        return zip((self.qkv, self.o, self.gate_up, self.down), sources, strict=True)


def _fp8_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    # As RMSNorm.forward: the Triton kernel on CUDA, the fp32 torch math elsewhere.
    h = (torch.ops.aiter.rms_norm(x, norm_weight, eps) if x.is_cuda and x.dtype == norm_weight.dtype
         else rms_norm(x, norm_weight, eps))
    out = fp8_linear(h, weight, weight_scale, bias)
    if gated:
        gate, up = out.chunk(2, dim=-1)
        out = F.silu(gate) * up
    return out


def _fp8_norm_linear_fake(x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None, gated: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2 if gated else weight.shape[0])


def _fp8_linear_add(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    out = fp8_linear(x, weight, weight_scale, bias)
    return out + residual if residual is not None else out


def _fp8_linear_add_fake(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


direct_register_custom_op("fp8_norm_linear", _fp8_norm_linear, fake_impl=_fp8_norm_linear_fake,
                          dispatch_key=("CPU", "CUDA"))
direct_register_custom_op("fp8_linear_add", _fp8_linear_add, fake_impl=_fp8_linear_add_fake,
                          dispatch_key=("CPU", "CUDA"))


def fp8_norm_linear(x: torch.Tensor, norm: RMSNorm, proj: Fp8Weights, bias: torch.Tensor | None,
                    gated: bool = False) -> torch.Tensor:
    """proj(norm(x)) [+ bias]; gated: SiLU(gate) * up of a merged gate/up projection."""
    return torch.ops.aiter.fp8_norm_linear(x, norm.weight, norm.eps, proj.weight, proj.scale,
                                           bias, gated)


def fp8_linear_add(x: torch.Tensor, proj: Fp8Weights, bias: torch.Tensor | None,
                   residual: torch.Tensor | None) -> torch.Tensor:
    """[residual +] proj(x) [+ bias]."""
    return torch.ops.aiter.fp8_linear_add(x, proj.weight, proj.scale, bias, residual)
