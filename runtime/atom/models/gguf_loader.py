"""Fill a model's weights from a GGUF file, one tensor at a time.

Each tensor is dequantized to float32 by `gguf` (numpy), its Q/K rows put back in the
checkpoint's order where llama.cpp's converter permuted them, and copied into the parameter
(or this rank's slice of it) in the serving dtype before the next one is read: host memory
peaks near the model in its serving dtype plus one float32 tensor. The file is memory-mapped,
so the quantized bytes are paged in as read.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from atom.layers.sharding import WeightTarget
from atom.models.gguf_config import PERMUTED_ARCHS
from atom.models.gguf_file import GGUFError, GGUFInfo, read_gguf
from atom.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

# Types `gguf.quants.dequantize` turns into float32 (the K-, IQ- and ternary quants included).
SUPPORTED_TYPES = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0",
)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Read into the config (rope scaling), not into a parameter.
_CONFIG_TENSORS = ("rope_freqs.weight",)
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (token_embd.weight -> model.embed_tokens.weight),
    or None for one the model has no parameter for."""
    m = _BLOCK.fullmatch(gguf_name)
    if m:
        layer, part, kind = m.groups()
        mapped = _LAYER_NAMES.get(part)
        return f"model.layers.{layer}.{mapped}.{kind}" if mapped else None
    base, _, kind = gguf_name.rpartition(".")
    mapped = _GLOBAL_NAMES.get(base)
    return f"{mapped}.{kind}" if mapped and kind in ("weight", "bias") else None


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head, its converter interleaved the two rotary
    halves' rows ([h, 2, d/2] -> [h, d/2, 2]); this puts them back in halves (rotate-half)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_types(info: GGUFInfo) -> None:
    """Refuse, before anything is read, a tensor of a type that is not dequantized here."""
    for t in info.tensors.values():
        if t.type_name not in SUPPORTED_TYPES:
            raise GGUFError(f"GGUF tensor {t.name!r} has quantization type {t.type_name}, which "
                            f"is not supported (supported: {', '.join(SUPPORTED_TYPES)})")


def plan(model: LlamaForCausalLM, info: GGUFInfo) -> dict[str, tuple[str, WeightTarget]]:
    """GGUF name -> (HF name, target) for every tensor the model needs, after checking that
    each is present with the model's shape."""
    targets = model.hf_weight_shards()
    by_hf = {h: g for g in info.tensors if (h := hf_name(g)) is not None}
    missing = [h for h in targets if h not in by_hf]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise GGUFError(f"{info.path.name} is missing tensor(s) for: {shown}")
    out: dict[str, tuple[str, WeightTarget]] = {}
    for h, target in targets.items():
        g = by_hf[h]
        shape, want = info.tensors[g].shape, tuple(target.full_shape)
        if shape != want:
            raise GGUFError(f"GGUF tensor {g!r} has shape {list(shape)}, the model expects "
                            f"{list(want)} for {h}")
        out[g] = (h, target)
    unused = sorted(set(info.tensors) - set(out) - set(_CONFIG_TENSORS) - {"output.weight"})
    if unused:
        logger.info("ignored %d GGUF tensors not used by the model, e.g. %s", len(unused), unused[0])
    return out


def _slice(full: torch.Tensor, target: WeightTarget) -> torch.Tensor:
    if target.shard is None:
        return full
    return full.narrow(target.shard.dim, target.shard.start, target.shard.length)


def load_gguf(model: LlamaForCausalLM, path: str | Path) -> int:
    """Copy every tensor the model needs from the GGUF file; returns how many were loaded."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    info = read_gguf(path)
    check_types(info)
    todo = plan(model, info)
    cfg = model.config
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    permuted = info.arch in PERMUTED_ARCHS
    reader = info.reader or GGUFReader(str(path))
    tensors = [t for t in reader.tensors if t.name in todo]
    with torch.no_grad():
        for t in tqdm(tensors, desc=f"loading {info.path.name}", unit="tensor", mininterval=1.0):
            h, target = todo[t.name]
            data = dequantize(t.data, t.tensor_type)
            if not data.flags.writeable:  # F32 comes back as a view of the read-only map
                data = np.array(data)
            full = torch.from_numpy(data.reshape(info.tensors[t.name].shape))
            proj = h.split(".")[-2]
            if permuted and proj in heads:
                full = unpermute_rows(full, heads[proj])
            dst = target.tensor
            dst.copy_(_slice(full, target).to(dtype=dst.dtype))
            del data, full
    return len(todo)
