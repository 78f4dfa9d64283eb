"""Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

One flat token dimension [T] for every step (prefill, decode or mixed): per-sequence
structure lives only in the attention op's metadata, so the backbone traces as one graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from atom.compilation.decorators import support_torch_compile
from atom.cudagraph.region_graph import token_graph
from atom.layers.attention import Attention
from atom.layers.linear import Linear, MergedLinear
from atom.layers.norm_linear import linear_add, norm_linear, project
from atom.layers.rmsnorm import RMSNorm
from atom.layers.rotary import RotaryEmbedding
from atom.models.registry import ModelConfig


def _max_positions(atom_config: Any, hf_config: ModelConfig) -> int:
    n = getattr(atom_config, "max_model_len", None) or hf_config.max_position_embeddings
    return int(min(n, hf_config.max_position_embeddings) if n else hf_config.max_position_embeddings)


class LlamaAttention(nn.Module):
    """Attention's weights and the step between its projections (the decoder layer runs the
    projections, fused with the norm before and the residual add after)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": self.q_size, "k": self.kv_size,
                                                       "v": self.kv_size}, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim ** -0.5, layer_id)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention over the merged q/k/v projection's output and
        o_proj. The attention op applies rotary and o_proj with the residual add (at decode
        sizes on CUDA, attention and o_proj are one launch)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        # strided views: the kernels read rows by stride
        return self.attn(q, k, v, positions, self.rotary_emb, o_proj=self.o_proj,
                         residual=residual, overlap=True)


class LlamaMLP(nn.Module):
    """The MLP's weights; the decoder layer runs them (gate_up with the norm and SiLU gate
    fused, down with the residual add)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu)")
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": cfg.intermediate_size,
                                                           "up": cfg.intermediate_size},
                                         bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream in, the residual stream out. Each norm runs inside the
        projection after it, the SiLU gate inside gate_up, and each residual add inside the
        projection before it (atom.layers.norm_linear: one kernel per projection at decode
        sizes on CUDA; o_proj inside the attention op)."""
        # overlap: in the forward no kernel writes the parameters, the cache or the step's
        # metadata, so each launch may start while the one before it ends.
        qkv = norm_linear(hidden, self.input_layernorm, self.self_attn.qkv_proj, overlap=True)
        hidden = self.self_attn.attend(positions, qkv, hidden)
        act = norm_linear(hidden, self.post_attention_layernorm, self.mlp.gate_up_proj,
                          gated=True, overlap=True)
        return linear_add(act, self.mlp.down_proj, hidden, overlap=True)


@token_graph
@support_torch_compile
class LlamaModel(nn.Module):
    """The compiled backbone: embeddings, decoder layers, final norm."""

    def __init__(self, *, atom_config: Any, hf_config: ModelConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        max_positions = _max_positions(atom_config, hf_config)
        self.embed_tokens = nn.Embedding(hf_config.vocab_size, hf_config.hidden_size)
        # One cos/sin table for all layers: 16 copies of a 128K-position table would hold
        # half a GiB, and the decode kernels of later layers find the step's row in L2.
        self.rotary_emb = RotaryEmbedding(hf_config.head_dim, max_positions,
                                          hf_config.rope_theta, hf_config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, i, self.rotary_emb)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, atom_config: Any, hf_config: ModelConfig) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(atom_config=atom_config, hf_config=hf_config)
        self.tie_word_embeddings = hf_config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = Linear(hf_config.hidden_size, hf_config.vocab_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype; the sampler widens only what it samples (a greedy step
        needs no fp32 copy of the vocabulary). At decode sizes on CUDA the projection kernel
        streams the vocabulary's rows (5 us a step under cuBLAS's on the H200, which also
        zeroes a workspace first: bench/RESULTS.md)."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return project(hidden_states, weight, None)

    def attention_layers(self) -> dict[int, Attention]:
        return {layer.self_attn.attn.layer_id: layer.self_attn.attn for layer in self.model.layers}

    def hf_weight_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> the tensor (or merged-weight view) it is copied into."""
        out: dict[str, torch.Tensor] = {
            "model.embed_tokens.weight": self.model.embed_tokens.weight.data,
            "model.norm.weight": self.model.norm.weight.data,
        }
        if not self.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight.data
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for shard in ("q", "k", "v"):
                for kind, view in attn.qkv_proj.shard_views(shard).items():
                    out[f"{p}self_attn.{shard}_proj.{kind}"] = view
            out[f"{p}self_attn.o_proj.weight"] = attn.o_proj.weight.data
            if attn.o_proj.bias is not None:
                out[f"{p}self_attn.o_proj.bias"] = attn.o_proj.bias.data
            if attn.qk_norm:
                out[f"{p}self_attn.q_norm.weight"] = attn.q_norm.weight.data
                out[f"{p}self_attn.k_norm.weight"] = attn.k_norm.weight.data
            for shard in ("gate", "up"):
                for kind, view in mlp.gate_up_proj.shard_views(shard).items():
                    out[f"{p}mlp.{shard}_proj.{kind}"] = view
            out[f"{p}mlp.down_proj.weight"] = mlp.down_proj.weight.data
            if mlp.down_proj.bias is not None:
                out[f"{p}mlp.down_proj.bias"] = mlp.down_proj.bias.data
            out[f"{p}input_layernorm.weight"] = layer.input_layernorm.weight.data
            out[f"{p}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight.data
        return out


# Hugging Face architecture names -> our class (all share the Llama decoder).
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
