"""The compile-cache directory hash.

It covers everything that changes compiled code (compilation config, model identity and
shapes, dtype, the traced graph, the traced source files, torch/triton/python versions) and
nothing per-process: a host name, pod IP, port, pid or replica index in the hash would make
every pod of a deployment recompile instead of sharing one cache volume.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch

HASH_LEN = 12


def stable_hash(obj: Any, length: int = HASH_LEN) -> str:
    """sha256 of a canonical JSON form (sorted keys; unknown objects by str())."""
    text = json.dumps(obj, sort_keys=True, default=_jsonable)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(str(x) for x in obj)
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        return str(obj)
    return str(obj)


def env_factors() -> dict[str, Any]:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # triton is optional on CPU-only installs
        triton_version = None
    return {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None),
        "triton": triton_version,
        "python": sys.version_info[:3],
    }


def files_hash(paths: Iterable[str]) -> dict[str, str]:
    """Content hash per traced source file; the key is the file name, not its full path,
    so two pods with different site-packages locations still agree."""
    out: dict[str, str] = {}
    for path in sorted(set(paths)):
        if not path or path.startswith("<") or not os.path.isfile(path):
            continue  # <string>, <frozen ...>: nothing on disk to hash
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        out[_portable_name(path)] = digest
    return out


def _portable_name(path: str) -> str:
    parts = os.path.normpath(path).split(os.sep)
    for anchor in ("site-packages", "dist-packages", "runtime", "tests"):
        if anchor in parts:
            return "/".join(parts[parts.index(anchor) + 1 :])
    return "/".join(parts[-3:])


def module_factors(module: Any) -> dict[str, Any]:
    """Model identity from the module itself: class, parameter/buffer shapes and dtypes,
    and its Hugging Face-style config if it carries one."""
    if not isinstance(module, torch.nn.Module):
        return {}
    cls = type(module)
    tensors = {
        name: [list(t.shape), str(t.dtype)]
        for name, t in list(module.named_parameters()) + list(module.named_buffers())
    }
    factors: dict[str, Any] = {"class": f"{cls.__module__}.{cls.__qualname__}", "tensors": tensors}
    cfg = getattr(module, "config", None) or getattr(module, "hf_config", None)
    cfg_dict = _config_dict(cfg)
    if cfg_dict is not None:
        factors["config"] = cfg_dict
    return factors


def _config_dict(cfg: Any) -> dict[str, Any] | None:
    if cfg is None:
        return None
    if hasattr(cfg, "to_dict"):
        data = dict(cfg.to_dict())
    elif isinstance(cfg, dict):
        data = dict(cfg)
    elif hasattr(cfg, "__dataclass_fields__"):
        from dataclasses import asdict

        data = asdict(cfg)
    else:
        return None
    # Where the files were read from is not part of what the model computes.
    for key in ("_name_or_path", "name_or_path", "path", "transformers_version", "_commit_hash"):
        data.pop(key, None)
    return data


def graph_factors(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> dict[str, Any]:
    """The traced graph's code and input metadata (shapes, strides, dtypes)."""
    inputs = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            inputs.append([str(tuple(x.shape)), str(x.stride()), str(x.dtype), x.device.type])
        else:
            inputs.append([type(x).__name__, str(x)])
    return {"code": graph.code, "inputs": inputs}


def compute_cache_hash(
    config_factors: dict[str, Any],
    module: Any = None,
    traced_files: Iterable[str] = (),
    graph: torch.fx.GraphModule | None = None,
    example_inputs: list[Any] | None = None,
    compiler_hash: str = "",
) -> tuple[str, dict[str, Any]]:
    """The directory hash and the factors it was computed from (kept for debugging)."""
    factors = {
        "config": config_factors,
        "module": module_factors(module),
        "files": files_hash(traced_files),
        "env": env_factors(),
        "compiler": compiler_hash,
    }
    if graph is not None:
        factors["graph"] = graph_factors(graph, example_inputs or [])
    return stable_hash(factors), factors
