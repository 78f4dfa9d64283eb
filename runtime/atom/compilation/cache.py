"""The persistent compile cache: where it lives and the per-piece compile-or-load.

CompilerManager compiles or loads each piece, keyed (runtime_shape, graph_index,
backend_name), and keeps the index `vllm_compile_cache.py` under
<cache root>/<hash>/rank_<i>/<prefix>/. The index is merged and replaced atomically, so pods
sharing one cache volume never see a torn file.
"""

from __future__ import annotations

import ast
import logging
import os
import pprint
import time
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from atom.compilation.compiler_interface import (
    CompilerInterface,
    CorruptArtifactError,
    atomic_write_bytes,
    make_compiler,
)
from atom.config import CompilationConfig, Config
from atom.utils.counters import counters

logger = logging.getLogger(__name__)

CACHE_INDEX_FILE = "vllm_compile_cache.py"


def get_rank() -> int:
    """This process's rank_<i> directory: its tensor-parallel rank when in a group of more than
    one (each rank compiles its own shard shapes), else the launcher's RANK (0 by default)."""
    from atom.distributed.parallel_state import tp_rank, tp_size

    if tp_size() > 1:
        return tp_rank()
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def default_cache_root() -> str:
    base = os.environ.get("ATOM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "atom")
    return os.path.join(base, "torch_compile_cache")


def cache_disabled() -> bool:
    return os.environ.get("ATOM_DISABLE_COMPILE_CACHE", "0").lower() in ("1", "true", "yes")





class CompilerManager:
    """Compile-or-load for each piece, keyed (runtime_shape, graph_index, backend_name)."""

    def __init__(self, compilation_config: CompilationConfig) -> None:
        self.compilation_config = compilation_config
        self.compiler: CompilerInterface = make_compiler(compilation_config.use_inductor)
        self.cache: dict[tuple[int | None, int, str], Any] = {}
        self.cache_dir = ""
        self.cache_file_path = ""
        self.disable_cache = True
        self.is_cache_updated = False

    def compute_hash(self, atom_config: Config) -> str:
        return self.compiler.compute_hash(atom_config)

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False, prefix: str = "") -> None:
        self.cache_dir = cache_dir
        self.disable_cache = disable_cache
        self.cache_file_path = os.path.join(cache_dir, CACHE_INDEX_FILE)
        self.cache = {} if disable_cache else self._read_index()
        if not disable_cache:
            os.makedirs(cache_dir, exist_ok=True)
        self.compiler.initialize_cache(cache_dir=cache_dir, disable_cache=disable_cache, prefix=prefix)

    def _read_index(self) -> dict[tuple[int | None, int, str], Any]:
        if not os.path.exists(self.cache_file_path):
            return {}
        try:
            with open(self.cache_file_path, encoding="utf-8") as f:
                data = ast.literal_eval(f.read())
            if not isinstance(data, dict):
                raise ValueError(f"expected a dict, got {type(data).__name__}")
            return data
        except (OSError, ValueError, SyntaxError, MemoryError, RecursionError) as exc:
            logger.warning("compile cache index %s is corrupt (%s); recompiling", self.cache_file_path, exc)
            return {}

    def save_to_file(self) -> None:
        """Merge with what other processes wrote, then replace the index atomically."""
        if self.disable_cache or not self.is_cache_updated:
            return
        merged = self._read_index()
        merged.update(self.cache)
        atomic_write_bytes(self.cache_file_path, pprint.pformat(merged).encode())
        self.is_cache_updated = False

    def load(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        graph_index: int,
        runtime_shape: int | None = None,
    ) -> Callable | None:
        key = (runtime_shape, graph_index, self.compiler.name)
        if self.disable_cache or key not in self.cache:
            return None
        try:
            compiled = self.compiler.load(self.cache[key], graph, example_inputs, graph_index, runtime_shape)
        except (CorruptArtifactError, ValueError, TypeError) as exc:
            logger.warning("compile cache entry %s is unusable (%s); recompiling", key, exc)
            counters.inc("cache_corrupt")  # shows a recompile that was not a plain miss
            del self.cache[key]
            return None
        logger.debug("loaded piece %s from %s", key, self.cache_dir)
        return compiled

    def compile(
        self,
        graph: fx.GraphModule,
        example_inputs: list[Any],
        additional_inductor_config: dict[str, Any],
        compilation_config: CompilationConfig | None = None,
        graph_index: int = 0,
        num_graphs: int = 1,
        runtime_shape: int | None = None,
    ) -> Callable:
        compiled = self.load(graph, example_inputs, graph_index, runtime_shape)
        if compiled is not None:
            counters.inc("cache_hits")
            return compiled
        counters.inc("cache_misses")
        start = time.perf_counter()
        key = f"artifact_shape_{runtime_shape}_subgraph_{graph_index}"
        compiled, handle = self.compiler.compile(
            graph, example_inputs, dict(additional_inductor_config), runtime_shape, key
        )
        assert compiled is not None
        counters.inc("pieces_compiled")
        if handle is not None and not self.disable_cache:
            self.cache[(runtime_shape, graph_index, self.compiler.name)] = handle
            self.is_cache_updated = True
            # Shape-specialised pieces compile lazily after the backend returned: persist now.
            if runtime_shape is not None:
                self.save_to_file()
        logger.debug(
            "compiled piece %d/%d (shape %s) in %.2fs",
            graph_index + 1, num_graphs, runtime_shape, time.perf_counter() - start,
        )
        return compiled

