"""The model shape the Llama-family model reads: one dataclass that config.json, GGUF metadata
and the built-in shapes all become (atom.models.registry, atom.models.gguf_config)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# Architectures handled by atom.models.llama (one decoder, switches below).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """The fields of a Hugging Face decoder config that the Llama-family model reads."""

    model_type: str = "llama"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "llama3" | "linear" | ..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    hidden_act: str = "silu"
    sliding_window: int | None = None  # Mistral; attention here is full, see max_model_len check
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    name: str = ""  # built-in name or checkpoint directory
    path: str | None = None  # checkpoint directory (None for built-in shapes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
