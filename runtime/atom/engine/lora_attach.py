"""Giving a built Llama-family model its LoRA buffers (before it is compiled or captured)."""

from __future__ import annotations

import torch

from atom.lora.config import LoRAConfig
from atom.lora.manager import LoRAManager
from atom.lora.weights import GroupShape
from atom.models.llama import LlamaDecoderLayer, LlamaForCausalLM


def _shapes(layer: LlamaDecoderLayer) -> dict[str, GroupShape]:
    attn, mlp = layer.self_attn, layer.mlp
    return {
        "qkv": GroupShape(attn.qkv_proj.in_features, attn.qkv_proj.shard_offsets()),
        "o": GroupShape(attn.o_proj.in_features, {"o": (0, attn.o_proj.out_features)}),
        "gate_up": GroupShape(mlp.gate_up_proj.in_features, mlp.gate_up_proj.shard_offsets()),
        "down": GroupShape(mlp.down_proj.in_features, {"down": (0, mlp.down_proj.out_features)}),
    }


def attach_lora(model: LlamaForCausalLM, config: LoRAConfig, max_rows: int,
                dtype: torch.dtype, device: torch.device) -> LoRAManager:
    """The manager of model's LoRA buffers; each decoder layer then runs its LoRA path. The
    --lora-modules adapters are loaded."""
    if model.tp.world_size > 1:
        raise ValueError("LoRA adapters are served at tensor_parallel_size 1 only")
    layers = model.model.decoder_layers()
    manager = LoRAManager(config, [_shapes(layer) for layer in layers], max_rows, dtype, device)
    for layer, lora in zip(layers, manager.layers, strict=True):
        layer.lora = lora
    manager.load_static()
    return manager
