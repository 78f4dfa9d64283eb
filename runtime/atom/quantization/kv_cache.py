"""The KV cache's element type for --kv-cache-dtype (the torch path's FP8 storage is
atom.kernels.fp8_cache; the Triton kernels branch on the cache's dtype)."""

from __future__ import annotations

import torch

from atom.kernels.fp8_cache import FP8_DTYPE


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's ("auto") or float8_e4m3fn ("fp8")."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return FP8_DTYPE
    raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {kv_cache_dtype!r}")
