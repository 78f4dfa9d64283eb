"""A GGUF file's metadata as the ModelConfig a Hugging Face config.json would give.

Keys follow llama.cpp's `{arch}.*` names; what metadata does not say, the tensor directory
does (an `output.weight` means untied embeddings, an `attn_q.bias` q/k/v bias, an
`attn_q_norm.weight` Qwen3's per-head norm).
"""

from __future__ import annotations

import math
from typing import Any

from atom.models.gguf_file import GGUFError, GGUFInfo
from atom.models.model_config import ModelConfig

# GGUF general.architecture values served by atom.models.llama.
GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
# llama.cpp's converter permutes q/k rows for the interleaved (GPT-J style) rotary of these;
# Qwen uses NeoX rotary and is stored as in the checkpoint.
PERMUTED_ARCHS = ("llama", "mistral")

# Llama 3.x ships its rope scaling as a `rope_freqs` tensor; these are the defaults of every
# released Llama 3.x config, checked against the tensor before use (llama3_scaling_from_freqs).
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL = 1.0, 4.0, 8192


def _require(info: GGUFInfo, key: str) -> Any:
    value = info.arch_key(key)
    if value is None:
        raise GGUFError(f"{info.path.name}: metadata has no {info.arch}.{key}")
    return value


def _rope_scaling(info: GGUFInfo) -> dict[str, Any] | None:
    kind = info.arch_key("rope.scaling.type")
    factor = info.arch_key("rope.scaling.factor")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    raise GGUFError(f"{info.path.name}: rope scaling type {kind!r} is not supported "
                    "(none, linear, and Llama 3's rope_freqs)")


def llama3_scaling_from_freqs(freq_factors: list[float], head_dim: int,
                              theta: float) -> dict[str, Any]:
    """The llama3 rope_scaling that reproduces a `rope_freqs` tensor (llama.cpp divides each
    frequency by its factor); refused when the released defaults do not reproduce it."""
    factor = max(freq_factors)
    scaling = {"rope_type": "llama3", "factor": float(factor), "low_freq_factor": _LLAMA3_LOW,
               "high_freq_factor": _LLAMA3_HIGH,
               "original_max_position_embeddings": _LLAMA3_ORIGINAL}
    low_wavelen, high_wavelen = _LLAMA3_ORIGINAL / _LLAMA3_LOW, _LLAMA3_ORIGINAL / _LLAMA3_HIGH
    for i, got in enumerate(freq_factors):
        wavelen = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelen < high_wavelen:
            want = 1.0
        elif wavelen > low_wavelen:
            want = factor
        else:
            smooth = (_LLAMA3_ORIGINAL / wavelen - _LLAMA3_LOW) / (_LLAMA3_HIGH - _LLAMA3_LOW)
            want = 1.0 / ((1 - smooth) / factor + smooth)
        if not math.isclose(got, want, rel_tol=1e-3):
            raise GGUFError("rope_freqs tensor does not match Llama 3 rope scaling "
                            f"(dimension {i}: {got:.4g}, expected {want:.4g})")
    return scaling


def model_config_from_gguf(info: GGUFInfo, name: str = "") -> ModelConfig:
    """The ModelConfig of a GGUF file; an unsupported architecture is a one-line GGUFError."""
    arch = info.arch
    if arch not in GGUF_ARCHS:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported "
                        f"(supported: {', '.join(GGUF_ARCHS)})")
    if "token_embd.weight" not in info.tensors:
        raise GGUFError(f"{info.path.name}: no token_embd.weight tensor")
    hidden = int(_require(info, "embedding_length"))
    heads = int(_require(info, "attention.head_count"))
    head_dim = int(info.arch_key("attention.key_length") or hidden // heads)
    rope_dims = info.arch_key("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(f"{info.path.name}: partial rotary ({rope_dims} of {head_dim} "
                        "dimensions) is not supported")
    vocab = info.tensors["token_embd.weight"].shape[0]
    has = info.tensors.__contains__
    eos = [int(i) for i in (info.get("tokenizer.ggml.eos_token_id"),
                            info.get("tokenizer.ggml.eot_token_id"),
                            info.get("tokenizer.ggml.eom_token_id")) if i is not None]
    bos = info.get("tokenizer.ggml.bos_token_id")
    window = info.arch_key("attention.sliding_window")
    theta = float(info.arch_key("rope.freq_base", 10000.0))
    scaling = _rope_scaling(info)
    if "rope_freqs.weight" in info.tensors:
        if info.rope_freqs is None or scaling is not None:
            raise GGUFError(f"{info.path.name}: this rope_freqs tensor is not supported")
        scaling = llama3_scaling_from_freqs(list(info.rope_freqs), head_dim, theta)
    return ModelConfig(
        model_type=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_require(info, "feed_forward_length")),
        num_hidden_layers=int(_require(info, "block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(info.arch_key("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(info.arch_key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(_require(info, "context_length")),
        tie_word_embeddings=not has("output.weight"),
        attention_bias=has("blk.0.attn_q.bias"),
        o_proj_bias=has("blk.0.attn_output.bias"),
        mlp_bias=has("blk.0.ffn_up.bias"),
        qk_norm=has("blk.0.attn_q_norm.weight"),
        sliding_window=int(window) if window and arch == "mistral" else None,
        torch_dtype=None,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_id=list(dict.fromkeys(eos)),
        name=name or info.path.stem,
        path=str(info.path),
    )
