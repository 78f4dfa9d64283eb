"""Runtime dispatch of one compiled piece: general shape, or a shape-specialised compile.

The piece is compiled once for the general (dynamic) batch dimension. Sizes listed in
compile_sizes are compiled again, lazily on their first use, with the size fixed; every
other size keeps using the general compile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from atom.config import Config
    from atom.utils.backends import VllmBackend

logger = logging.getLogger(__name__)


@dataclass
class ConcreteSizeEntry:
    runtime_shape: int
    need_to_compile: bool  # the size is in compile_sizes
    compiled: bool = False
    runnable: Callable | None = None


class PiecewiseBackend:
    def __init__(
        self,
        graph: torch.fx.GraphModule,
        atom_config: Config,
        piecewise_compile_index: int,
        total_piecewise_compiles: int,
        sym_shape_indices: list[int],
        compiled_graph_for_general_shape: Callable,
        vllm_backend: VllmBackend,
    ) -> None:
        self.graph = graph
        self.atom_config = atom_config
        self.compilation_config = atom_config.compilation_config
        self.piecewise_compile_index = piecewise_compile_index
        self.total_piecewise_compiles = total_piecewise_compiles
        self.is_first_graph = piecewise_compile_index == 0
        self.is_last_graph = piecewise_compile_index == total_piecewise_compiles - 1
        self.sym_shape_indices = sym_shape_indices
        self.compiled_graph_for_general_shape = compiled_graph_for_general_shape
        self.vllm_backend = vllm_backend
        self.first_run_finished = False

        sizes = [s for s in self.compilation_config.compile_sizes or [] if isinstance(s, int)]
        self.compile_sizes: set[int] = set(sizes)
        self.to_be_compiled_sizes: set[int] = set(sizes)
        self.concrete_size_entries: dict[int, ConcreteSizeEntry] = {
            s: ConcreteSizeEntry(runtime_shape=s, need_to_compile=True) for s in sizes
        }

    def _runtime_shape(self, args: tuple[Any, ...]) -> int | None:
        if not self.sym_shape_indices:
            return None  # a piece with no dynamic size: one compile serves all
        value = args[self.sym_shape_indices[0]]
        return int(value) if isinstance(value, (int, torch.SymInt)) else None

    def __call__(self, *args: Any) -> Any:
        if not self.first_run_finished:
            self.first_run_finished = True
            return self.compiled_graph_for_general_shape(*args)
        shape = self._runtime_shape(args)
        entry = self.concrete_size_entries.get(shape) if shape is not None else None
        if entry is None:
            return self.compiled_graph_for_general_shape(*args)
        if entry.need_to_compile and not entry.compiled:
            entry.compiled = True
            self.to_be_compiled_sizes.discard(entry.runtime_shape)
            entry.runnable = self.vllm_backend.compiler_manager.compile(
                self.graph,
                list(args),
                self.compilation_config.inductor_compile_config,
                graph_index=self.piecewise_compile_index,
                num_graphs=self.total_piecewise_compiles,
                runtime_shape=entry.runtime_shape,
            )
        runnable = entry.runnable or self.compiled_graph_for_general_shape
        return runnable(*args)
