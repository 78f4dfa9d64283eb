"""Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

One flat token dimension [T] for every step (prefill, decode or mixed): per-sequence
structure lives only in the attention op's metadata, so the backbone traces as one graph.

Tensor parallelism (atom.distributed, tp_size() > 1 when the group is set up before the model
is built): q/k/v and gate/up are column-parallel (each rank its heads, KV heads and MLP
columns), o_proj and down_proj row-parallel (a partial sum per rank, rank 0's carrying the
residual stream and the bias, then one all-reduce), the embedding and the logits
vocab-parallel. At TP = 1 the layers, kernels and fusions are those of the single GPU.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from atom.compilation.decorators import support_torch_compile
from atom.cudagraph.region_graph import token_graph
from atom.distributed.communication import (
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)
from atom.distributed.parallel_state import TPState, tp_state
from atom.layers.attention import Attention
from atom.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
from atom.layers.norm_linear import linear_add, norm_linear, project
from atom.layers.rmsnorm import RMSNorm
from atom.layers.rotary import RotaryEmbedding
from atom.layers.sharding import WeightTarget, split_evenly
from atom.layers.vocab_embedding import VocabParallelEmbedding
from atom.lora.weights import LoRALayer
from atom.models.model_config import ModelConfig
from atom.quantization.fp8_layers import Fp8Projections, fp8_linear_add, fp8_norm_linear


def _max_positions(atom_config: Any, hf_config: ModelConfig) -> int:
    n = getattr(atom_config, "max_model_len", None) or hf_config.max_position_embeddings
    return int(min(n, hf_config.max_position_embeddings) if n else hf_config.max_position_embeddings)


def check_tensor_parallel(cfg: ModelConfig, tp: TPState) -> None:
    """Every size split over the ranks must divide evenly: a ValueError naming the first that
    does not (before any layer is built)."""
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                  "vocab_size"):
        split_evenly(int(getattr(cfg, field)), tp.world_size, tp.rank, field)


class LlamaAttention(nn.Module):
    """Attention's weights and the step between its projections (the decoder layer runs the
    projections, fused with the norm before and the residual add after)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPState) -> None:
        super().__init__()
        self.tp = tp
        # This rank's heads and KV heads (all of them at TP = 1).
        _, self.num_heads = split_evenly(cfg.num_attention_heads, tp.world_size, tp.rank,
                                         "num_attention_heads")
        _, self.num_kv_heads = split_evenly(cfg.num_key_value_heads, tp.world_size, tp.rank,
                                            "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        full_q, full_kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": full_q, "k": full_kv, "v": full_kv},
                                     bias=cfg.attention_bias, tp_size=tp.world_size,
                                     tp_rank=tp.rank)
        self.o_proj = RowParallelLinear(full_q, cfg.hidden_size, bias=cfg.o_proj_bias,
                                        tp_size=tp.world_size, tp_rank=tp.rank,
                                        field="num_attention_heads * head_dim")
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim ** -0.5, layer_id)

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v of the merged projection's output (q and k normed under qk_norm)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm:
            t = q.shape[0]
            q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim)).reshape(t, self.q_size)
            k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim)).reshape(t, self.kv_size)
        return q, k, v

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention over the merged q/k/v projection's output and
        o_proj. The attention op applies rotary and o_proj with the residual add (at decode
        sizes on CUDA, attention and o_proj are one launch)."""
        q, k, v = self.split_qkv(qkv)
        # strided views: the kernels read rows by stride
        if self.tp.world_size == 1:
            return self.attn(q, k, v, positions, self.rotary_emb, o_proj=self.o_proj,
                             residual=residual, overlap=True)
        # Row-parallel o_proj: rank 0's partial sum carries the residual (once), then the sum.
        partial = self.attn(q, k, v, positions, self.rotary_emb, o_proj=self.o_proj,
                            residual=residual if self.tp.rank == 0 else None, overlap=True)
        return tensor_parallel_all_reduce(partial)


class LlamaMLP(nn.Module):
    """The MLP's weights; the decoder layer runs them (gate_up with the norm and SiLU gate
    fused, down with the residual add)."""

    def __init__(self, cfg: ModelConfig, tp: TPState) -> None:
        super().__init__()
        if cfg.hidden_act != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu)")
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": cfg.intermediate_size,
                                                           "up": cfg.intermediate_size},
                                         bias=cfg.mlp_bias, tp_size=tp.world_size,
                                         tp_rank=tp.rank)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size,
                                           bias=cfg.mlp_bias, tp_size=tp.world_size,
                                           tp_rank=tp.rank, field="intermediate_size")


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary_emb: RotaryEmbedding,
                 tp: TPState, quantization: str = "none") -> None:
        super().__init__()
        self.tp = tp
        self.self_attn = LlamaAttention(cfg, layer_id, rotary_emb, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Multi-LoRA (atom.engine.lora_attach sets it): the projections run unfused, each plus its
        # rows' adapter update. None: the fused path below, untouched.
        self.lora: LoRALayer | None = None
        # --quantization fp8: the projections' FP8 weights, filled by quantize_weights once
        # the checkpoint is in the bf16 layers (atom.quantization.fp8_layers).
        self.fp8: Fp8Projections | None = (
            Fp8Projections(*self.projection_weights()) if quantization == "fp8" else None)

    def projection_weights(self) -> tuple[nn.Parameter, ...]:
        attn, mlp = self.self_attn, self.mlp
        return (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight,
                mlp.down_proj.weight)

    def quantize_weights(self) -> None:
        """FP8 weights from the loaded bf16 ones, which are then freed (no-op without fp8)."""
        if self.fp8 is None:
            return
        for fp8, weight in self.fp8.pairs(self.projection_weights()):
            fp8.quantize_from(weight.data)
        norm = self.input_layernorm.weight
        for proj in (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp.gate_up_proj,
                     self.mlp.down_proj):
            proj.weight = nn.Parameter(torch.empty(0, dtype=norm.dtype, device=norm.device),
                                       requires_grad=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream in, the residual stream out. Each norm runs inside the
        projection after it, the SiLU gate inside gate_up, and each residual add inside the
        projection before it (atom.layers.norm_linear: one kernel per projection at decode
        sizes on CUDA; o_proj inside the attention op)."""
        if self.lora is not None:
            return self._forward_lora(self.lora, positions, hidden)
        if self.fp8 is not None:
            return self._forward_fp8(self.fp8, positions, hidden)
        # overlap: in the forward no kernel writes the parameters, the cache or the step's
        # metadata, so each launch may start while the one before it ends.
        qkv = norm_linear(hidden, self.input_layernorm, self.self_attn.qkv_proj, overlap=True)
        hidden = self.self_attn.attend(positions, qkv, hidden)
        act = norm_linear(hidden, self.post_attention_layernorm, self.mlp.gate_up_proj,
                          gated=True, overlap=True)
        if self.tp.world_size == 1:
            return linear_add(act, self.mlp.down_proj, hidden, overlap=True)
        partial = linear_add(act, self.mlp.down_proj, hidden if self.tp.rank == 0 else None,
                             overlap=True)
        return tensor_parallel_all_reduce(partial)

    def _forward_fp8(self, fp8: Fp8Projections, positions: torch.Tensor,
                     hidden: torch.Tensor) -> torch.Tensor:
        """forward's math with the FP8 projections (atom.quantization.fp8_layers): each norm
        inside the projection after it, the residual add inside the one before; attention's
        o_proj is an op of its own here."""
        attn, mlp = self.self_attn, self.mlp
        # A row-parallel rank other than 0 must not carry the residual stream a second time.
        carry = self.tp.world_size == 1 or self.tp.rank == 0
        qkv = fp8_norm_linear(hidden, self.input_layernorm, fp8.qkv, attn.qkv_proj.bias)
        q, k, v = attn.split_qkv(qkv)
        out = attn.attn(q, k, v, positions, attn.rotary_emb, overlap=True)
        hidden = fp8_linear_add(out, fp8.o, attn.o_proj.bias, hidden if carry else None)
        if self.tp.world_size > 1:
            hidden = tensor_parallel_all_reduce(hidden)
        act = fp8_norm_linear(hidden, self.post_attention_layernorm, fp8.gate_up,
                              mlp.gate_up_proj.bias, gated=True)
        out = fp8_linear_add(act, fp8.down, mlp.down_proj.bias, hidden if carry else None)
        return tensor_parallel_all_reduce(out) if self.tp.world_size > 1 else out

    def _forward_lora(self, lora: LoRALayer, positions: torch.Tensor,
                      hidden: torch.Tensor) -> torch.Tensor:
        """forward's math with each projection's LoRA delta added to its output (before the
        SiLU gate for gate/up): the norms and projections as separate ops, since the delta
        needs each projection's input (one rank only: atom.engine.lora_attach)."""
        attn, mlp = self.self_attn, self.mlp
        x = self.input_layernorm(hidden)
        qkv = linear_add(x, attn.qkv_proj, None) + lora.delta("qkv", x)
        q, k, v = attn.split_qkv(qkv)
        out = attn.attn(q, k, v, positions, attn.rotary_emb)
        hidden = linear_add(out, attn.o_proj, hidden) + lora.delta("o", out)
        x = self.post_attention_layernorm(hidden)
        gate, up = (linear_add(x, mlp.gate_up_proj, None) + lora.delta("gate_up", x)).chunk(2, -1)
        act = torch.nn.functional.silu(gate) * up
        return linear_add(act, mlp.down_proj, hidden) + lora.delta("down", act)


@token_graph
@support_torch_compile
class LlamaModel(nn.Module):
    """The compiled backbone: embeddings, decoder layers, final norm."""

    def __init__(self, *, atom_config: Any, hf_config: ModelConfig, prefix: str = "") -> None:
        super().__init__()
        self.config = hf_config
        max_positions = _max_positions(atom_config, hf_config)
        tp = tp_state()
        check_tensor_parallel(hf_config, tp)
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = (
            nn.Embedding(hf_config.vocab_size, hf_config.hidden_size) if tp.world_size == 1
            else VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size,
                                        tp.world_size, tp.rank))
        # One cos/sin table for all layers: 16 copies of a 128K-position table would hold
        # half a GiB, and the decode kernels of later layers find the step's row in L2.
        self.rotary_emb = RotaryEmbedding(hf_config.head_dim, max_positions,
                                          hf_config.rope_theta, hf_config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, i, self.rotary_emb, tp, atom_config.quantization)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def decoder_layers(self) -> list[LlamaDecoderLayer]:
        """self.layers, typed (nn.ModuleList yields nn.Module)."""
        return cast(list[LlamaDecoderLayer], list(self.layers))


class LlamaForCausalLM(nn.Module):
    def __init__(self, atom_config: Any, hf_config: ModelConfig) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(atom_config=atom_config, hf_config=hf_config)
        self.tie_word_embeddings = hf_config.tie_word_embeddings
        self.tp = tp_state()
        if not self.tie_word_embeddings:
            # Vocab-parallel at TP > 1: this rank's rows of the vocabulary.
            self.lm_head: Linear = (
                Linear(hf_config.hidden_size, hf_config.vocab_size) if self.tp.world_size == 1
                else ColumnParallelLinear(hf_config.hidden_size, hf_config.vocab_size,
                                          tp_size=self.tp.world_size, tp_rank=self.tp.rank,
                                          field="vocab_size"))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype; the sampler widens only what it samples (a greedy step
        needs no fp32 copy of the vocabulary). At decode sizes on CUDA the projection kernel
        streams the vocabulary's rows (5 us a step under cuBLAS's on the H200, which also
        zeroes a workspace first: bench/RESULTS.md)."""
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        # TP > 1: this rank's vocabulary columns, joined in rank order.
        return tensor_parallel_all_gather(project(hidden_states, weight, None), dim=-1)

    def num_params(self) -> int:
        """This rank's weights, counted once: parameters, and FP8 projections (buffers) in
        place of the bf16 ones they replaced."""
        fp8 = [layer.fp8 for layer in self.model.decoder_layers() if layer.fp8 is not None]
        return (sum(p.numel() for p in self.parameters())
                + sum(w.weight.numel() for f in fp8 for w in (f.qkv, f.o, f.gate_up, f.down)))

    def quantize_loaded_weights(self) -> None:
        """Once the checkpoint is loaded: the FP8 weights of --quantization fp8 (a no-op
        without it)."""
        for layer in self.model.decoder_layers():
            layer.quantize_weights()

    def attention_layers(self) -> dict[int, Attention]:
        return {layer.self_attn.attn.layer_id: layer.self_attn.attn for layer in self.model.decoder_layers()}

    def hf_weight_targets(self) -> dict[str, torch.Tensor]:
        """Hugging Face tensor name -> the tensor (or merged-weight view) it is copied into."""
        return {name: t.tensor for name, t in self.hf_weight_shards().items()}

    def hf_weight_shards(self) -> dict[str, WeightTarget]:
        """Hugging Face tensor name -> its target here, its full checkpoint shape and (at
        TP > 1, for a sharded tensor) the slice of it this rank reads."""
        def whole(name: str, t: torch.Tensor) -> dict[str, WeightTarget]:
            return {name: WeightTarget(t.data, tuple(t.shape))}

        embed = self.model.embed_tokens
        out: dict[str, WeightTarget] = (
            embed.weight_targets("model.embed_tokens") if isinstance(embed, VocabParallelEmbedding)
            else whole("model.embed_tokens.weight", embed.weight))
        out.update(whole("model.norm.weight", self.model.norm.weight))
        if not self.tie_word_embeddings:
            out.update(self.lm_head.weight_targets("lm_head"))
        for i, layer in enumerate(self.model.decoder_layers()):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for shard in ("q", "k", "v"):
                for kind, target in attn.qkv_proj.shard_targets(shard).items():
                    out[f"{p}self_attn.{shard}_proj.{kind}"] = target
            out.update(attn.o_proj.weight_targets(f"{p}self_attn.o_proj"))
            if attn.qk_norm:
                out.update(whole(f"{p}self_attn.q_norm.weight", attn.q_norm.weight))
                out.update(whole(f"{p}self_attn.k_norm.weight", attn.k_norm.weight))
            for shard in ("gate", "up"):
                for kind, target in mlp.gate_up_proj.shard_targets(shard).items():
                    out[f"{p}mlp.{shard}_proj.{kind}"] = target
            out.update(mlp.down_proj.weight_targets(f"{p}mlp.down_proj"))
            out.update(whole(f"{p}input_layernorm.weight", layer.input_layernorm.weight))
            out.update(whole(f"{p}post_attention_layernorm.weight",
                             layer.post_attention_layernorm.weight))
        return out


# Hugging Face architecture names -> our class (all share the Llama decoder).
MODEL_CLASSES = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
