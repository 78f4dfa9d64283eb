"""Build a model and fill its weights: safetensors (single file or sharded), GGUF
(atom.models.gguf_loader) or dummy random.

Tensor names are Hugging Face's; the model says where each one goes (`hf_weight_targets`).
Every expected tensor is checked against the checkpoint's headers before anything is copied,
so a missing or misshapen tensor fails fast with its name, file and shapes.

Under tensor parallelism a rank reads only its slice of each sharded tensor
(`safe_open(...).get_slice(name)[...]`), after checking the full tensor's shape; dummy
weights are cut from the full tensor a single rank would draw, so TP ranks hold exactly the
TP = 1 values.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

import torch
from safetensors import safe_open

from atom.distributed.parallel_state import tp_size
from atom.layers.sharding import WeightTarget, cut
from atom.models.gguf_file import GGUF_SUFFIX
from atom.models.gguf_loader import load_gguf
from atom.models.llama import LlamaForCausalLM
from atom.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "half": torch.float16,
          "float": torch.float32}


class WeightLoadError(ValueError):
    """A checkpoint does not match the model built from its config."""


def is_gguf(path: str | None) -> bool:
    return bool(path) and str(path).endswith(GGUF_SUFFIX)


def resolve_dtype(dtype: str, hf_config: ModelConfig) -> torch.dtype:
    """'auto' takes the checkpoint's torch_dtype (bf16 when it has none)."""
    if dtype == "auto":
        dtype = hf_config.torch_dtype or "bfloat16"
        if dtype == "float32" and torch.cuda.is_available():
            dtype = "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported ({', '.join(sorted(DTYPES))})")
    return DTYPES[dtype]


def safetensors_files(path: str) -> dict[str, str]:
    """Tensor name -> file, from model.safetensors.index.json or the *.safetensors files."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        out = {}
        for name, fname in weight_map.items():
            full = os.path.join(path, fname)
            if not os.path.isfile(full):
                raise WeightLoadError(f"{index} maps tensor {name!r} to {fname!r}, which does not exist")
            out[name] = full
        return out
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise WeightLoadError(f"no *.safetensors files in {path!r} (use --load-format dummy for random weights)")
    out = {}
    for full in files:
        with safe_open(full, framework="pt") as f:
            for name in f.keys():
                out[name] = full
    return out


def _check_shapes(targets: dict[str, WeightTarget], where: dict[str, str]) -> None:
    missing = [name for name in targets if name not in where]
    if missing:
        shown = ", ".join(missing[:5]) + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
        raise WeightLoadError(f"checkpoint is missing tensor(s): {shown}")
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(where[name], []).append(name)
    for fname, names in by_file.items():
        with safe_open(fname, framework="pt") as f:
            for name in names:
                shape = tuple(f.get_slice(name).get_shape())
                want = tuple(targets[name].full_shape)
                if shape != want:
                    raise WeightLoadError(
                        f"tensor {name!r} in {os.path.basename(fname)} has shape {list(shape)}, "
                        f"the model expects {list(want)}"
                    )


def _read(f: Any, name: str, target: WeightTarget) -> torch.Tensor:
    """The tensor, or only this rank's slice of it (the rest of the file is never read)."""
    if target.shard is None:
        return f.get_tensor(name)
    index = [slice(None)] * len(target.full_shape)
    index[target.shard.dim] = slice(target.shard.start, target.shard.start + target.shard.length)
    return f.get_slice(name)[tuple(index)]


def load_safetensors(model: LlamaForCausalLM, path: str) -> int:
    """Copy every expected tensor (this rank's slice of a sharded one) into the model;
    returns how many were loaded."""
    targets = model.hf_weight_shards()
    where = safetensors_files(path)
    _check_shapes(targets, where)
    by_file: dict[str, list[str]] = {}
    for name in targets:
        by_file.setdefault(where[name], []).append(name)
    with torch.no_grad():
        for fname, names in by_file.items():
            with safe_open(fname, framework="pt") as f:
                for name in names:
                    dst = targets[name].tensor
                    dst.copy_(_read(f, name, targets[name]).to(device=dst.device, dtype=dst.dtype))
    unused = sorted(set(where) - set(targets) - {"lm_head.weight"})
    if unused:
        logger.info("ignored %d checkpoint tensors not used by the model, e.g. %s", len(unused), unused[0])
    return len(targets)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights with a sane scale (finite logits in bf16); norms stay at one. A shard
    (tp_pieces) is cut from the full tensor drawn as at TP = 1, in the same order."""
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                # Generated on the parameter's device: a 1B model in seconds on a GPU.
                gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
                full_shape = getattr(p, "tp_full_shape", None)
                if full_shape is None:
                    p.normal_(0.0, 0.02, generator=gen)
                else:
                    full = torch.empty(full_shape, dtype=p.dtype, device=p.device)
                    p.copy_(cut(full.normal_(0.0, 0.02, generator=gen), p))


def build_model(config: Any, hf_config: ModelConfig) -> LlamaForCausalLM:
    """Construct on the config's device and dtype, then load or randomise the weights."""
    want_tp = int(getattr(config, "tensor_parallel_size", 1))
    if want_tp != tp_size():
        raise ValueError(f"tensor_parallel_size={want_tp} but this process's tensor-parallel "
                         f"group has {tp_size()} rank(s): call "
                         "atom.distributed.parallel_state.init_tensor_parallel first")
    dtype = resolve_dtype(config.dtype, hf_config)
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    load_format = getattr(config, "load_format", "auto")
    gguf = is_gguf(hf_config.path)
    if load_format == "auto":
        load_format = "gguf" if gguf else "safetensors" if hf_config.path else "dummy"
    if load_format == "safetensors" and gguf:
        raise WeightLoadError(f"model {hf_config.name!r} is a GGUF file ({hf_config.path}): "
                              "use --load-format auto")
    if load_format == "safetensors" and not hf_config.path:
        raise WeightLoadError(
            f"model {hf_config.name!r} is a built-in shape without weights: use --load-format dummy"
        )
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config, hf_config)
    finally:
        torch.set_default_dtype(old_dtype)
    if load_format == "dummy":
        init_dummy_weights(model, getattr(config, "seed", 0))
    elif load_format == "gguf":
        load_gguf(model, str(hf_config.path))
    else:
        assert hf_config.path is not None  # refused above without one
        load_safetensors(model, hf_config.path)
    model.quantize_loaded_weights()  # --quantization fp8: from the loaded weights
    return model.eval()
