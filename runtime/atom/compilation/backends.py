"""The torch.compile backend for levels 2 and 3 and the runtime dispatch of its pieces.

VllmBackend receives Dynamo's graph, splits it at the splitting ops (level 3; level 2 keeps
one piece; atom.compilation.splitting), compiles every non-splitting piece for the general
batch size through CompilerManager (atom.compilation.cache), and returns the stitched graph.
Each compiled piece is a PiecewiseBackend: the general-shape compile, plus the sizes listed
in compile_sizes compiled again lazily on their first use with the size fixed. Both live in
this module so that the backend and its pieces no longer import each other.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from atom.compilation.cache import (
    CACHE_INDEX_FILE,
    CompilerManager,
    cache_disabled,
    default_cache_root,
    get_rank,
)
from atom.compilation.compiler_interface import InductorStandaloneAdaptor, atomic_write_bytes
from atom.compilation.hashing import compute_cache_hash
from atom.compilation.splitting import (
    BufferMutationError,
    SplitItem,
    canonicalize_names,
    find_buffer_mutations,
    op_name,
    split_graph,
)
from atom.compilation.warm_start import (
    TracedGraph,
    WarmStartMiss,
    describe_trace,
    dynamic_input_indices,
    pickle_split_graph,
)
from atom.config import CompilationConfig, CompilationLevel, Config, CUDAGraphMode
from atom.utils.counters import counters

logger = logging.getLogger(__name__)

__all__ = [
    "CACHE_INDEX_FILE", "BufferMutationError", "CompilerManager", "ConcreteSizeEntry",
    "PiecewiseBackend", "PiecewiseCompileInterpreter", "SplitItem", "VllmBackend",
    "cache_disabled", "canonicalize_names", "debug_dump_dir", "default_cache_root",
    "find_buffer_mutations", "get_rank", "make_backend", "op_name", "split_graph",
    "traced_inputs",
]


def debug_dump_dir(compilation_config: CompilationConfig) -> str | None:
    if not compilation_config.debug_dump_path:
        return None
    path = os.path.join(compilation_config.debug_dump_path, f"rank_{get_rank()}")
    os.makedirs(path, exist_ok=True)
    return path


def traced_inputs(graph: fx.GraphModule) -> list[Any]:
    """The placeholders' traced values (FakeTensors with symbolic sizes, SymInts)."""
    return [n.meta.get("example_value") for n in graph.graph.nodes if n.op == "placeholder"]


# --------------------------------------------------------------------------- pieces


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


# --------------------------------------------------------------------------- backend


class PiecewiseCompileInterpreter(torch.fx.Interpreter):
    """Runs the split graph on fake inputs and swaps each compiled piece for a
    PiecewiseBackend compiled for the general shape."""

    def __init__(
        self,
        module: fx.GraphModule,
        compile_submod_names: list[str],
        atom_config: Config,
        vllm_backend: VllmBackend,
    ) -> None:
        super().__init__(module)
        from torch._guards import detect_fake_mode

        self.fake_mode = detect_fake_mode()
        self.compile_submod_names = compile_submod_names
        self.atom_config = atom_config
        self.compilation_config = atom_config.compilation_config
        self.vllm_backend = vllm_backend

    def run(self, *args: Any, initial_env: dict[fx.Node, Any] | None = None,
            enable_io_processing: bool = True) -> Any:
        from torch._dispatch.python import enable_python_dispatcher

        if self.fake_mode is None:
            return super().run(*args, initial_env=initial_env,
                               enable_io_processing=enable_io_processing)
        fake_args = [self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*fake_args, initial_env=initial_env,
                               enable_io_processing=enable_io_processing)

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        assert isinstance(target, str)
        output = super().call_module(target, args, kwargs)
        if target in self.compile_submod_names:
            index = self.compile_submod_names.index(target)
            submod = self.fetch_attr(target)
            sym_shape_indices = [i for i, x in enumerate(args) if isinstance(x, torch.SymInt)]
            general = self.vllm_backend.compiler_manager.compile(
                submod,
                list(args),
                self.compilation_config.inductor_compile_config,
                self.compilation_config,
                graph_index=index,
                num_graphs=len(self.compile_submod_names),
                runtime_shape=None,
            )
            self.module.__dict__[target] = PiecewiseBackend(
                submod,
                self.atom_config,
                index,
                len(self.compile_submod_names),
                sym_shape_indices,
                general,
                self.vllm_backend,
            )
        return output


class VllmBackend:
    """torch.compile backend: split (level 3) or keep whole (level 2), compile each piece."""

    def __init__(
        self,
        atom_config: Config,
        prefix: str = "backbone",
        piecewise: bool | None = None,
        module: torch.nn.Module | None = None,
    ) -> None:
        self.atom_config = atom_config
        self.compilation_config = atom_config.compilation_config
        self.prefix = prefix
        if piecewise is None:
            piecewise = self.compilation_config.level == CompilationLevel.PIECEWISE
        self.piecewise = piecewise
        self.module = module
        self.compiler_manager = CompilerManager(self.compilation_config)
        self.graph_count = 0
        self.hash_key = ""
        self.hash_factors: dict[str, Any] = {}
        self.local_cache_dir = ""
        self.split_gm: fx.GraphModule | None = None
        self.graph: fx.GraphModule | None = None
        self.piecewise_graphs: list[SplitItem] = []
        self._input_buffers: dict[int, torch.Tensor] = {}
        self.traced: TracedGraph | None = None

    def configure_cache(self, graph: fx.GraphModule, example_inputs: list[Any]) -> None:
        from torch._guards import TracingContext

        cc = self.compilation_config
        for code in TracingContext.get_traced_code() or []:
            cc.traced_files.add(code.co_filename)
        self.hash_key, self.hash_factors = compute_cache_hash(
            self.atom_config.compile_hash_factors(),
            module=self.module,
            traced_files=cc.traced_files,
            graph=graph,
            # Symbolic placeholders, not the real first-call tensors: the hash must not
            # depend on the batch size the first call happened to have.
            example_inputs=traced_inputs(graph),
            compiler_hash=self.compiler_manager.compute_hash(self.atom_config),
        )
        self._use_cache_dir()
        if not self.compiler_manager.disable_cache:
            # What the hash was computed from, to explain a miss.
            text = json.dumps(self.hash_factors, sort_keys=True, indent=1, default=str)
            atomic_write_bytes(os.path.join(self.local_cache_dir, "hash_factors.json"), text.encode())

    def cache_root(self) -> str:
        return self.compilation_config.cache_dir or default_cache_root()

    def _use_cache_dir(self) -> None:
        cc = self.compilation_config
        prefix = self.prefix if self.graph_count == 0 else f"{self.prefix}_{self.graph_count}"
        self.local_cache_dir = os.path.join(self.cache_root(), self.hash_key, f"rank_{get_rank()}", prefix)
        cc.local_cache_dir = self.local_cache_dir
        self.compiler_manager.initialize_cache(self.local_cache_dir, cache_disabled(), prefix)

    def __call__(self, graph: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        counters.inc("graphs_compiled")
        self.graph = graph
        mutated = find_buffer_mutations(graph)
        if mutated:
            raise BufferMutationError(
                "the compiled forward modifies nn.Module buffer(s) "
                f"{', '.join(mutated)}; buffers must not be assigned or modified during the "
                "forward pass (CUDA graphs and the guard-free dispatcher would silently replay "
                "stale state). Keep state in the forward context or use compilation level 0."
            )
        self.configure_cache(graph, example_inputs)
        if not self.compiler_manager.disable_cache and self._loads_without_trace():
            self.traced = describe_trace(graph)  # for a later warm start without Dynamo
        cc = self.compilation_config
        ops = list(cc.splitting_ops or []) if self.piecewise else []
        self.split_gm, self.piecewise_graphs = split_graph(graph, ops)
        counters.inc("pieces", len(self.piecewise_graphs))
        to_compile = [item.submod_name for item in self.piecewise_graphs if not item.is_splitting_graph]
        if self.traced is not None:  # before compiled pieces replace the fx ones
            self.traced.split_graph = pickle_split_graph(self.split_gm) or b""
            self.traced.compile_order = to_compile
        PiecewiseCompileInterpreter(self.split_gm, to_compile, self.atom_config, self).run(*example_inputs)
        self.compiler_manager.save_to_file()
        self._save_graphs(graph)
        self.graph_count += 1
        return self._callable(dynamic_input_indices(traced_inputs(graph)))

    def from_trace(self, split_gm: fx.GraphModule, hash_key: str, dynamic_inputs: list[int],
                   piece_sym_indices: dict[str, list[int]]) -> Callable:
        """The compiled callable for a saved trace (atom.compilation.warm_start): the split module
        with every piece loaded from the artifact cache; a missing piece raises WarmStartMiss."""
        if not self._loads_without_trace():
            raise WarmStartMiss("only standalone Inductor artifacts load without a trace")
        self.hash_key = hash_key
        self._use_cache_dir()
        self.graph, self.split_gm = None, split_gm
        names = list(piece_sym_indices)
        for index, name in enumerate(names):
            submod = getattr(split_gm, name)
            general = self.compiler_manager.load(submod, [], index)
            if general is None:
                raise WarmStartMiss(f"piece {index} is not in the artifact cache")
            counters.inc("cache_hits")
            split_gm.__dict__[name] = PiecewiseBackend(
                submod, self.atom_config, index, len(names), piece_sym_indices[name], general, self
            )
        counters.inc("pieces", sum(1 for _ in split_gm.children()))
        self.graph_count += 1
        return self._callable(dynamic_inputs)

    def _loads_without_trace(self) -> bool:
        """Only standalone Inductor artifacts load without the tracing context."""
        return self.compiler_manager.compiler.name == InductorStandaloneAdaptor.name

    def _callable(self, sym_indices: list[int]) -> Callable:
        cc = self.compilation_config
        use_copy = (
            cc.cudagraph_copy_inputs
            and cc.level == CompilationLevel.PIECEWISE
            and cc.cudagraph_mode not in (None, CUDAGraphMode.NONE)
        )
        assert self.split_gm is not None
        if not use_copy:
            return self.split_gm
        return self._copy_inputs_wrapper(sym_indices)

    def _save_graphs(self, graph: fx.GraphModule) -> None:
        assert self.split_gm is not None
        src = "from __future__ import annotations\nimport torch\n" + self.split_gm.print_readable(
            print_output=False
        )
        src = src.replace("<lambda>", "GraphModule")
        if not self.compiler_manager.disable_cache:
            atomic_write_bytes(os.path.join(self.local_cache_dir, "computation_graph.py"), src.encode())
        dump = debug_dump_dir(self.compilation_config)
        if dump:
            with open(os.path.join(dump, f"{self.prefix}_computation_graph.py"), "w") as f:
                f.write(src)
            with open(os.path.join(dump, f"{self.prefix}_dynamo_graph.py"), "w") as f:
                f.write(graph.print_readable(print_output=False))

    def _copy_inputs_wrapper(self, sym_indices: list[int]) -> Callable:
        """Copy dynamic-size tensor inputs (at sym_indices) into static buffers so a captured
        graph always reads the same addresses."""
        split_gm = self.split_gm
        assert split_gm is not None
        floor = max(self.compilation_config.cudagraph_capture_sizes or [1])

        def copy_and_call(*args: Any) -> Any:
            list_args = list(args)
            for index in sym_indices:
                x = list_args[index]
                n = x.shape[0]
                buf = self._input_buffers.get(index)
                if buf is None or buf.shape[0] < n or buf.shape[1:] != x.shape[1:] or buf.dtype != x.dtype:
                    # Grows only before capture in practice: capture runs the largest size first.
                    buf = torch.empty((max(n, floor), *x.shape[1:]), dtype=x.dtype, device=x.device)
                    self._input_buffers[index] = buf
                static = buf[:n]
                static.copy_(x)
                list_args[index] = static
            return split_gm(*list_args)

        return copy_and_call


def make_backend(atom_config: Config, module: torch.nn.Module | None = None, prefix: str = "backbone") -> VllmBackend:
    return VllmBackend(atom_config, prefix=prefix, module=module)

