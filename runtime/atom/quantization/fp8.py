"""FP8 weights and activations: quantization and the scaled GEMM.

Weights: float8_e4m3fn with one fp32 scale per output channel (row), w ~= w_fp8 * scale[:, None].
Activations: one fp32 scale per token (row), computed from the row's absolute maximum at run
time, so no calibration data is needed. On CUDA the product is `torch._scaled_mm` with
row-wise scales (scale_a [M, 1], scale_b [1, N], output in bf16); elsewhere (the CPU tests) the
reference path dequantizes both operands and multiplies in fp32, the same quantization
error without the FP8 tensor cores.
"""

from __future__ import annotations

import torch

from atom.kernels.fp8_cache import FP8_DTYPE, FP8_MAX

# A row of zeros gets this scale rather than 0 (which would divide by zero).
MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in FP8, fp32 scales [rows, 1]) with x ~= x_fp8 * scale, one scale per row."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(MIN_SCALE)
    # Clamped before the cast: float8_e4m3fn has no infinity, an overflow would be NaN.
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [out, in] in FP8, fp32 scales [out]): one scale per output channel."""
    q, scale = quantize_rows(weight)
    return q, scale.reshape(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of FP8 rows and their scales ([rows] or [rows, 1])."""
    return q.float() * scale.reshape(-1, 1)


def scaled_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm's constraints: CUDA, both dimensions of the weight a multiple of 16."""
    return x.is_cuda and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] (the model's dtype) times the FP8 weight [out, in]^T (+ bias), in x's dtype.
    x is quantized per token here."""
    xq, x_scale = quantize_rows(x)
    if scaled_mm_supported(x, weight):
        # Row-wise scaled FP8 GEMM: bf16 out (the row-wise recipe's output type); the weight's
        # transpose is the column-major operand it wants, with no copy.
        out = torch._scaled_mm(xq, weight.t(), scale_a=x_scale,
                               scale_b=weight_scale.reshape(1, -1), out_dtype=torch.bfloat16)
        # The bias (Qwen2's q/k/v) added after: one launch, on no row-wise kernel's terms.
        out = out.to(x.dtype)
        return out if bias is None else out + bias
    out = dequantize(xq, x_scale) @ dequantize(weight, weight_scale).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
