"""Warm start without Dynamo: reuse a saved trace instead of tracing the forward again.

The artifact cache makes a warm start skip Inductor, but Dynamo still re-traces the whole
forward (seconds for a 16-layer model: most of a warm start). After a cold compile we save
what the trace produced, all of it plain data:
- Dynamo's FX graph as split into pieces (metadata stripped, pickled);
- where each graph input comes from, as the Python expression Dynamo itself recorded
  (`L['self']._modules['layers']...`, `L['input_ids'].size()[0]`);
- each piece's dynamic-size argument positions (the forward returns the graph's one output), the
  artifact directory's hash and the content hash of every traced source file.
A later process with the same pre-trace key (compile config, model structure, argument
layout, torch/triton/Python versions) and unchanged traced files rebuilds the compiled
callable from this entry and the artifacts, and never runs Dynamo. Anything unexpected (a
file changed, a piece missing from the artifact cache, an unpicklable graph) means no entry,
or no use of it: the caller traces as before, so correctness never depends on this file.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from atom.compilation.compiler_interface import atomic_write_bytes
from atom.compilation.hashing import env_factors, files_hash, module_factors, stable_hash
from atom.utils.counters import counters

logger = logging.getLogger(__name__)

ENTRY_VERSION = 1
ENTRY_FILE = "dynamo_trace.pkl"


class WarmStartMiss(RuntimeError):
    """The saved trace cannot be used as is (the caller traces with Dynamo instead)."""


@dataclass
class TraceEntry:
    version: int
    graph: bytes  # pickled split fx.GraphModule (metadata stripped, pieces not compiled)
    sources: list[str]  # per graph input: expression over L (the forward's arguments)
    dynamic_inputs: list[int]  # graph inputs whose dimension 0 is the dynamic batch size
    piece_sym_indices: dict[str, list[int]]  # compiled pieces in index order: their size args
    hash_key: str  # the artifact directory's hash
    traced_files: list[str]
    files: dict[str, str] = field(default_factory=dict)  # content hash per traced file


_SIGNATURES: dict[type[torch.nn.Module], inspect.Signature] = {}


def _forward_signature(cls: type[torch.nn.Module]) -> inspect.Signature:
    # A dict, not functools.cache: mypy takes a class object for an unhashable instance.
    sig = _SIGNATURES.get(cls)
    if sig is None:
        sig = _SIGNATURES[cls] = inspect.signature(cls.forward)
    return sig


def bind_arguments(module: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The forward's arguments by name, `self` included: what Dynamo's sources call L."""
    bound = _forward_signature(type(module)).bind(module, *args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def pretrace_key(module: Any, prefix: str, args: tuple, kwargs: dict) -> str:
    """What the trace depends on, known before tracing (the traced files are checked after)."""
    layout: dict[str, object] = {}
    for name, value in bind_arguments(module, args, kwargs).items():
        if isinstance(value, torch.Tensor):
            layout[name] = [str(value.dtype), value.device.type, list(value.shape[1:])]
        elif name != "self":
            layout[name] = type(value).__name__
    return stable_hash({
        "config": module.atom_config.compile_hash_factors(),
        "module": module_factors(module),
        "prefix": prefix,
        "arguments": layout,
        "env": env_factors(),
        "version": ENTRY_VERSION,
    })


def entry_path(cache_root: str, key: str, rank: int, prefix: str) -> str:
    return os.path.join(cache_root, "dynamo_traces", key, f"rank_{rank}", prefix, ENTRY_FILE)


def _input_source(node: fx.Node) -> str | None:
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name
    return name if isinstance(name, str) else name()


def _sources_function(sources: list[str]) -> Callable[[dict[str, Any]], list[Any]]:
    # The expressions are Dynamo's own source names, written by our cold start into our
    # cache (as trusted as the Inductor code loaded next to them).
    return eval("lambda L: [" + ", ".join(sources) + ",]")  # noqa: S307


@dataclass
class TracedGraph:
    """What a trace says about its graph, taken while Dynamo's metadata is still attached
    (Dynamo drops the input sources once the backend returns)."""

    sources: list[str]
    dynamic_inputs: list[int]
    tensor_ranks: list[int | None]  # per input: tensor rank, None for a size
    split_graph: bytes = b""  # the split module before its pieces were compiled
    compile_order: list[str] = field(default_factory=list)  # its compiled pieces, by index


def describe_trace(graph: fx.GraphModule) -> TracedGraph | None:
    """Called by the backend on Dynamo's graph; None if it is not replayable from plain data
    (reason logged at debug level)."""
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    sources = [_input_source(n) for n in placeholders]
    if any(s is None for s in sources) or any(n.op == "get_attr" for n in graph.graph.nodes):
        logger.debug("warm start: graph inputs without a source, or module attributes")
        return None
    out_node = next(n for n in graph.graph.nodes if n.op == "output")
    outs = out_node.args[0] if isinstance(out_node.args[0], (tuple, list)) else (out_node.args[0],)
    if len(outs) != 1:
        logger.debug("warm start: the graph has %d outputs, not one", len(outs))
        return None
    examples = [n.meta.get("example_value") for n in placeholders]
    ranks = [x.dim() if isinstance(x, torch.Tensor) else None for x in examples]
    return TracedGraph([s for s in sources if s is not None], dynamic_input_indices(examples), ranks)


def dynamic_input_indices(examples: list[Any]) -> list[int]:
    """Positions of the traced inputs (FakeTensors, SymInts) whose shape holds a symbolic size."""
    return [i for i, x in enumerate(examples)
            if isinstance(x, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in x.shape)]


def pickle_split_graph(split_gm: fx.GraphModule) -> bytes | None:
    """The split module and its pieces, metadata stripped (fake tensors do not pickle);
    None if it does not round-trip."""
    clean = copy.deepcopy(split_gm)
    for gm in [clean, *clean.children()]:
        if isinstance(gm, fx.GraphModule):
            for node in gm.graph.nodes:
                node.meta = {}
            gm.recompile()
    try:
        blob = pickle.dumps(clean)
        pickle.loads(blob)
    except Exception as exc:  # noqa: BLE001 - any pickling failure: no entry
        logger.debug("warm start: split graph does not pickle: %s", exc)
        return None
    return blob


def build_entry(backend: Any, module: Any, args: tuple, kwargs: dict, output: Any
                ) -> TraceEntry | None:
    """The entry for the trace the backend just compiled, or None if it is not replayable."""
    traced: TracedGraph | None = getattr(backend, "traced", None)
    if traced is None or not traced.split_graph or not isinstance(output, torch.Tensor):
        return None
    # The sources must resolve, now, to inputs of the traced kinds.
    resolved = _sources_function(traced.sources)(bind_arguments(module, args, kwargs))
    for value, rank in zip(resolved, traced.tensor_ranks, strict=True):
        if (rank is None) != (not isinstance(value, torch.Tensor)):
            return None
        if rank is not None and value.dim() != rank:
            return None
    # The compiled pieces (PiecewiseBackend) sit in the split module's __dict__.
    pieces = {name: list(sub.sym_shape_indices) for name, sub in backend.split_gm.__dict__.items()
              if hasattr(sub, "sym_shape_indices")}
    files = sorted(backend.compilation_config.traced_files)
    if sorted(pieces) != sorted(traced.compile_order):
        return None
    return TraceEntry(ENTRY_VERSION, traced.split_graph, traced.sources, traced.dynamic_inputs,
                      {name: pieces[name] for name in traced.compile_order}, backend.hash_key,
                      files, files_hash(files))


def save(path: str, entry: TraceEntry) -> None:
    atomic_write_bytes(path, pickle.dumps(entry))
    counters.inc("dynamo_traces_saved")


def load(path: str) -> TraceEntry | None:
    """The entry at path if it is readable, of this version, and its traced files are
    unchanged; otherwise None (logged)."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            entry = pickle.load(f)
    except Exception as exc:  # noqa: BLE001 - a corrupt entry: trace again
        logger.warning("saved Dynamo trace %s is unreadable (%s); tracing again", path, exc)
        return None
    if not isinstance(entry, TraceEntry) or entry.version != ENTRY_VERSION:
        return None
    if files_hash(entry.traced_files) != entry.files:
        logger.info("traced source files changed since %s was saved; tracing again", path)
        return None
    return entry


def graph_of(entry: TraceEntry) -> fx.GraphModule:
    return pickle.loads(entry.graph)


def make_forward(entry: TraceEntry, compiled: Callable) -> Callable[[Any, tuple, dict], Any]:
    """forward(module, args, kwargs) running the compiled graph on the resolved inputs."""
    inputs_of = _sources_function(entry.sources)

    def forward(module: Any, args: tuple, kwargs: dict) -> Any:
        return compiled(*inputs_of(bind_arguments(module, args, kwargs)))[0]

    return forward
