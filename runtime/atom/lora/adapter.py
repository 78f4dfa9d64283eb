"""Reading a PEFT LoRA adapter: adapter_config.json and adapter_model.safetensors.

Supported: plain LoRA (no DoRA, no bias, no extra trained modules) on the decoder's attention
and MLP projections, scaling lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). Anything else is
refused by name rather than served wrong.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Hugging Face module name -> (our projection group, shard inside it)
TARGETS: dict[str, tuple[str, str]] = {
    "q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"),
    "o_proj": ("o", "o"),
    "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"),
    "down_proj": ("down", "down"),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
# Options whose non-default values change the math in ways this runtime does not implement.
_REFUSED = {"use_dora": False, "bias": "none", "modules_to_save": None, "rank_pattern": {},
            "alpha_pattern": {}, "fan_in_fan_out": False, "layers_to_transform": None}


@dataclass(frozen=True)
class LoRAPair:
    """One projection's update: delta(x) = x @ a.T @ b.T, with the scaling folded into b."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r], already scaled


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    pairs: dict[tuple[int, str], LoRAPair]  # (layer, Hugging Face module name) -> update


def read_adapter_config(path: Path) -> dict[str, object]:
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
    data = json.loads(cfg_path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{cfg_path} is not a JSON object")
    if str(data.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {data.get('peft_type')!r} is not LORA")
    for key, default in _REFUSED.items():
        value = data.get(key, default)
        if value not in (default, None, {}, [], False, "none"):
            raise ValueError(f"{cfg_path}: {key}={value!r} is not supported")
    return data


def load_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """The adapter at `path` (a directory), its rank at most max_rank; a ValueError naming
    the first problem (missing file, unsupported option or module, rank too large)."""
    from safetensors.torch import load_file

    root = Path(path)
    cfg = read_adapter_config(root)
    rank = int(cfg.get("r", 8))  # type: ignore[call-overload]
    if rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: r={rank} must be positive")
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above --max-lora-rank="
                         f"{max_rank}")
    alpha = float(cfg.get("lora_alpha", rank))  # type: ignore[arg-type]
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights_path = root / WEIGHTS_FILE
    if not weights_path.is_file():
        raise ValueError(f"LoRA adapter {str(root)!r} has no {WEIGHTS_FILE}")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_path)).items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in TARGETS:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA weight of a "
                             f"supported module ({', '.join(TARGETS)})")
        halves.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    pairs: dict[tuple[int, str], LoRAPair] = {}
    for where, ab in halves.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {where[0]} {where[1]} lacks "
                             f"lora_{'A' if 'A' not in ab else 'B'}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: layer {where[0]} {where[1]} has rank "
                             f"{a.shape[0]}, the config says r={rank}")
        pairs[where] = LoRAPair(a.float(), b.float() * scaling)
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights")
    return LoRAAdapter(name, str(root), rank, scaling, pairs)
