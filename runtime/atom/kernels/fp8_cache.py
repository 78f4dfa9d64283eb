"""An FP8 KV cache in the torch path (--kv-cache-dtype fp8; atom.quantization.kv_cache picks
the dtype): elements are value / scale in float8_e4m3fn, clamped to its range (an overflow
would be NaN: the format has no infinity), widened back on read.

The scales are per tensor and 1.0 unless a checkpoint brings calibrated ones: post-norm,
post-rotary keys and values of the Llama family sit well inside +-448, where e4m3's relative
step (2^-3) is the error whatever the scale (vLLM's default for uncalibrated FP8 KV is the
same). The Triton kernels store and read the same elements (triton_attention.cache_value).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
DEFAULT_KV_SCALE = 1.0


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def to_cache(rows: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
    """rows in the cache's element type (scaled and clamped for FP8)."""
    if not is_fp8(cache):
        return rows.to(cache.dtype)
    return (rows.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def from_cache(values: torch.Tensor, scale: float) -> torch.Tensor:
    """Cache elements as fp32 values."""
    out = values.float()
    return out * scale if values.dtype == FP8_DTYPE and scale != 1.0 else out


def scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache.view(-1, ...)[slots] = rows, for FP8 too (index_copy_ has no CPU FP8 kernel: the
    bytes are copied as uint8)."""
    flat = cache.view(-1, *cache.shape[2:])
    if is_fp8(cache):
        flat.view(torch.uint8).index_copy_(0, slots, rows.view(torch.uint8))
    else:
        flat.index_copy_(0, slots, rows)
