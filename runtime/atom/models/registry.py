"""Model shapes: parsed from a Hugging Face config.json or a GGUF file, or built in by name.

Built-in shapes let `--model llama-3.2-1b --load-format dummy` run with no files; the tiny
ones keep CPU tests fast.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from atom.models.gguf_config import model_config_from_gguf
from atom.models.gguf_file import PACKAGED_MODELS, find_gguf, read_gguf
from atom.models.model_config import SUPPORTED_MODEL_TYPES, ModelConfig


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def model_config_from_hf(data: dict[str, Any], name: str = "", path: str | None = None) -> ModelConfig:
    """Map a config.json dict (transformers 4.x or 5.x layout) to a ModelConfig."""
    model_type = str(data.get("model_type", "llama"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    hidden = int(data["hidden_size"])
    heads = int(data["num_attention_heads"])
    # transformers 5 folds rope_theta and rope_scaling into rope_parameters.
    rope = dict(data.get("rope_parameters") or {})
    scaling = data.get("rope_scaling") or None
    rope_theta: float = rope.get("rope_theta", 10000.0)
    theta = data.get("rope_theta", rope_theta)
    if scaling is None and rope:
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        scaling.setdefault("rope_type", scaling.get("type", "default"))
    is_qwen2 = model_type == "qwen2"
    bias = bool(data.get("attention_bias", is_qwen2))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(data["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(data["intermediate_size"]),
        num_hidden_layers=int(data["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or hidden // heads),
        rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        attention_bias=bias,
        # Llama puts attention_bias on o_proj too; Qwen2 biases only q/k/v.
        o_proj_bias=bias and model_type in ("llama", "mistral"),
        mlp_bias=bool(data.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        hidden_act=str(data.get("hidden_act", "silu")),
        # Qwen2/3 configs carry a sliding_window that is off unless use_sliding_window is set.
        sliding_window=(data.get("sliding_window") if model_type == "mistral"
                        or data.get("use_sliding_window") else None),
        torch_dtype=data.get("torch_dtype", data.get("dtype")),
        bos_token_id=data.get("bos_token_id"),
        eos_token_id=_eos_list(data.get("eos_token_id")),
        name=name,
        path=path,
    )


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Llama 3.1 stretches an 8K-trained rotary table by 8 (3.2's by 32).
_LLAMA31_SCALING = dict(_LLAMA3_SCALING, factor=8.0)

BUILTIN_SHAPES: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2],
    ),
    "tiny-qwen3": ModelConfig(
        model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=2048,
        tie_word_embeddings=True, qk_norm=True, bos_token_id=1, eos_token_id=[2],
    ),
    "llama-3.2-1b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_SCALING),
        max_position_embeddings=131072, tie_word_embeddings=True, torch_dtype="bfloat16",
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
    "qwen3-0.6b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=True, qk_norm=True, torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=[151645, 151643],
    ),
    # The 8B class the peers publish figures for (issue 47): the shapes of the released
    # config.json files, random weights (--load-format dummy).
    "llama-3.1-8b": ModelConfig(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=dict(_LLAMA31_SCALING),
        max_position_embeddings=131072, tie_word_embeddings=False, torch_dtype="bfloat16",
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
    "qwen3-8b": ModelConfig(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        tie_word_embeddings=False, qk_norm=True, torch_dtype="bfloat16",
        bos_token_id=151643, eos_token_id=[151645, 151643],
    ),
}


def builtin_names() -> list[str]:
    return sorted(BUILTIN_SHAPES)


def load_model_config(name_or_path: str) -> ModelConfig:
    """A GGUF file (a .gguf path, a directory holding one, or a packaged model's name), a
    directory holding config.json, or a built-in shape name."""
    gguf_path = find_gguf(name_or_path)
    if gguf_path is not None:
        name = name_or_path if name_or_path in PACKAGED_MODELS else ""
        return model_config_from_gguf(read_gguf(gguf_path), name=name)
    cfg_file = os.path.join(name_or_path, "config.json")
    if os.path.isdir(name_or_path):
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"model directory {name_or_path!r} has no config.json")
        with open(cfg_file, encoding="utf-8") as f:
            data = json.load(f)
        return model_config_from_hf(data, name=os.path.basename(os.path.normpath(name_or_path)),
                                    path=name_or_path)
    if name_or_path in BUILTIN_SHAPES:
        cfg = copy.deepcopy(BUILTIN_SHAPES[name_or_path])
        cfg.name = name_or_path
        return cfg
    raise ValueError(
        f"model {name_or_path!r} is neither a GGUF file, a directory with config.json or a "
        f"GGUF, a packaged model ({', '.join(sorted(PACKAGED_MODELS))}) nor a built-in shape "
        f"({', '.join(builtin_names())})"
    )
