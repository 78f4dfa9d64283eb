"""Quantized weights and KV cache (issue 47): FP8 (float8_e4m3fn) on Hopper.

- `--quantization fp8`: each decoder projection's weight is quantized at load, with one scale
  per output channel; activations get one scale per token at run time (atom.quantization.fp8,
  the ops in atom.quantization.fp8_layers). Embeddings, norms and the logits projection stay
  in the model's dtype.
- `--kv-cache-dtype fp8`: the paged KV cache holds float8_e4m3fn with per-tensor scales
  (atom.quantization.kv_cache; the storage in atom.kernels.fp8_cache).

The choices live in atom.config (QUANTIZATIONS, KV_CACHE_DTYPES), which imports no torch.
"""
