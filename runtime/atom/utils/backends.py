"""The torch.compile backend for levels 2 and 3, and the persistent compile cache.

VllmBackend receives Dynamo's graph, splits it at the splitting ops (level 3; level 2 keeps
one piece), compiles every non-splitting piece for the general batch size through
CompilerManager, and returns the stitched graph. CompilerManager compiles or loads each
piece and keeps the index `vllm_compile_cache.py` under
<cache root>/<hash>/rank_<i>/<prefix>/.
"""

from __future__ import annotations

import ast
import json
import logging
import operator
import os
import pprint
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.passes.split_module  # not loaded by `import torch.fx`

from atom.config import CompilationConfig, CompilationLevel, Config, CUDAGraphMode
from atom.utils.compile_hash import compute_cache_hash
from atom.utils.compiler_interface import (
    CompilerInterface,
    CorruptArtifactError,
    InductorStandaloneAdaptor,
    atomic_write_bytes,
    make_compiler,
)
from atom.utils.counters import counters
from atom.utils.cuda_piecewise_backend import PiecewiseBackend
from atom.utils.warm_start import (
    TracedGraph,
    WarmStartMiss,
    describe_trace,
    dynamic_input_indices,
    pickle_split_graph,
)

logger = logging.getLogger(__name__)

CACHE_INDEX_FILE = "vllm_compile_cache.py"


class BufferMutationError(RuntimeError):
    """The compiled forward assigns or modifies an nn.Module buffer."""


def get_rank() -> int:
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def default_cache_root() -> str:
    base = os.environ.get("ATOM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "atom")
    return os.path.join(base, "torch_compile_cache")


def cache_disabled() -> bool:
    return os.environ.get("ATOM_DISABLE_COMPILE_CACHE", "0").lower() in ("1", "true", "yes")


def debug_dump_dir(compilation_config: CompilationConfig) -> str | None:
    if not compilation_config.debug_dump_path:
        return None
    path = os.path.join(compilation_config.debug_dump_path, f"rank_{get_rank()}")
    os.makedirs(path, exist_ok=True)
    return path


def traced_inputs(graph: fx.GraphModule) -> list[Any]:
    """The placeholders' traced values (FakeTensors with symbolic sizes, SymInts)."""
    return [n.meta.get("example_value") for n in graph.graph.nodes if n.op == "placeholder"]


# --------------------------------------------------------------------------- splitting


@dataclass
class SplitItem:
    submod_name: str
    graph_id: int
    is_splitting_graph: bool
    graph: fx.GraphModule


def op_name(target: Any) -> str | None:
    """'aiter.foo' for torch.ops.aiter.foo and torch.ops.aiter.foo.default."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[-1]}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).replace("::", ".")
    return None


def split_graph(graph: fx.GraphModule, ops: list[str]) -> tuple[fx.GraphModule, list[SplitItem]]:
    """Cut the graph around every call of a splitting op: each such call is its own piece."""
    wanted = set(ops)
    subgraph_id = 0
    node_to_subgraph: dict[fx.Node, int] = {}
    split_ids: set[int] = set()
    for node in graph.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and op_name(node.target) in wanted:
            subgraph_id += 1
            node_to_subgraph[node] = subgraph_id
            split_ids.add(subgraph_id)
            subgraph_id += 1
        else:
            node_to_subgraph[node] = subgraph_id
    split_gm = torch.fx.passes.split_module.split_module(
        graph, None, lambda node: node_to_subgraph[node], keep_original_order=True
    )
    items = []
    for name, module in split_gm.named_children():
        graph_id = int(name.replace("submod_", ""))
        if graph_id not in split_ids:
            canonicalize_names(module)
        items.append(SplitItem(name, graph_id, graph_id in split_ids, module))
    items.sort(key=lambda item: item.graph_id)
    return split_gm, items


def canonicalize_names(piece: fx.GraphModule) -> None:
    """Name a piece's values by position (arg_0.., val_0..), not after the layer they came
    from: identical layers then give identical graphs, so Inductor's graph cache serves the
    repeats of a cold compile and their artifacts are byte-identical (loaded once when warm).
    The split module calls pieces positionally, so the names are free to change."""
    for i, node in enumerate(n for n in piece.graph.nodes if n.op == "placeholder"):
        node.target = f"arg_{i}"
        node._rename(f"arg_{i}")
    for i, node in enumerate(n for n in piece.graph.nodes if n.op not in ("placeholder", "output")):
        node._rename(f"val_{i}")
    piece.recompile()


# --------------------------------------------------------------------------- buffer check

_VIEW_METHODS = {
    "view", "reshape", "narrow", "select", "flatten", "unsqueeze", "squeeze", "transpose",
    "permute", "t", "expand", "as_strided", "__getitem__", "view_as", "unflatten", "chunk",
    "split", "contiguous", "detach",
}
_INPLACE_FUNCS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv}


def _is_buffer_placeholder(node: fx.Node) -> bool:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    name = source.name if isinstance(getattr(source, "name", None), str) else None
    if name is None and source is not None and callable(getattr(source, "name", None)):
        name = source.name()
    text = name or node.target or node.name
    return "_buffers" in str(text)


def find_buffer_mutations(graph: fx.GraphModule) -> list[str]:
    """Names of module buffers (or views of them) that the graph writes in place."""
    aliases: dict[fx.Node, str] = {}
    mutated: list[str] = []
    for node in graph.graph.nodes:
        if node.op == "placeholder":
            if _is_buffer_placeholder(node):
                aliases[node] = str(node.target)
            continue
        first = node.args[0] if node.args else None
        base = aliases.get(first) if isinstance(first, fx.Node) else None
        if base is None:
            continue
        target = node.target
        fname = target if isinstance(target, str) else getattr(target, "__name__", "")
        if node.op == "call_method" and target in _VIEW_METHODS:
            aliases[node] = base
        elif node.op == "call_function" and target is operator.getitem:
            aliases[node] = base
        elif node.op == "call_function" and target in _INPLACE_FUNCS:
            mutated.append(base)
        elif isinstance(target, torch._ops.OpOverload) and any(
            a.alias_info is not None and a.alias_info.is_write for a in target._schema.arguments[:1]
        ):
            mutated.append(base)
        elif node.op in ("call_method", "call_function") and fname.endswith("_") and not fname.startswith("_"):
            mutated.append(base)
    return sorted(set(mutated))


# --------------------------------------------------------------------------- cache


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

    def run(self, *args: Any) -> Any:
        from torch._dispatch.python import enable_python_dispatcher

        if self.fake_mode is None:
            return super().run(*args)
        fake_args = [self.fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in args]
        with self.fake_mode, enable_python_dispatcher():
            return super().run(*fake_args)

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
        """The compiled callable for a saved trace (atom.utils.warm_start): the split module
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

