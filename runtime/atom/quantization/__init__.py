"""Quantized weights and KV cache (issue 47): FP8 (float8_e4m3fn) on Hopper.

- `--quantization fp8`: each decoder projection's weight is quantized at load, with one scale
  per output channel; activations get one scale per token at run time (atom.quantization.fp8).
  Embeddings, norms and the logits projection stay in the model's dtype.
- `--kv-cache-dtype fp8`: the paged KV cache holds float8_e4m3fn with per-tensor scales
  (atom.quantization.kv_cache).

Kept free of torch imports: the command line (atom.cli.args) reads the choices from here.
"""

from __future__ import annotations

QUANTIZATIONS = ("none", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")


def precision_factors(quantization: str, kv_cache_dtype: str) -> dict[str, str]:
    """The compile-cache key's precision lines (Config.compile_hash_factors): FP8 weights and
    an FP8 KV cache are other compiled code and other captured kernels. Left out at the
    defaults so existing caches keep their key."""
    out: dict[str, str] = {}
    if quantization != "none":
        out["quantization"] = quantization
    if kv_cache_dtype != "auto":
        out["kv_cache_dtype"] = kv_cache_dtype
    return out
