"""RMSNorm computed in fp32, as Hugging Face Llama/Qwen do, cast back to the input dtype.

Inside a decoder layer the norms run within the projections after them
(atom.layers.norm_linear); this module holds their weights and serves the final norm and the
q/k norms. On CUDA those run as the op `aiter::rms_norm`, one Triton kernel (opaque to
Dynamo, so every compilation level runs the same kernel): without torch.compile the torch
math is eight kernels, 15 us of a batch-1 decode step on the H200 (bench/RESULTS.md).
"""

from __future__ import annotations

import torch
from torch import nn

from atom.compilation.custom_ops import direct_register_custom_op


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_norm_kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from atom.kernels.triton_norm_gemv import rms_norm_rows

    return rms_norm_rows(x, weight, eps)


def _rms_norm_fake(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


direct_register_custom_op("rms_norm", _rms_norm_kernel, fake_impl=_rms_norm_fake)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == self.weight.dtype:
            return torch.ops.aiter.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
