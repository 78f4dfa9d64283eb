"""Cutting Dynamo's graph into pieces at the splitting ops, and the buffer-mutation check.

`split_graph` gives every call of a splitting op its own piece (level 3); the pieces between
are what `atom.compilation.backends.VllmBackend` compiles. `find_buffer_mutations` refuses a
forward that writes an nn.Module buffer (graphs would replay stale state).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.fx.passes.split_module  # not loaded by `import torch.fx`


class BufferMutationError(RuntimeError):
    """The compiled forward assigns or modifies an nn.Module buffer."""



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
    # No root module: split_module reads it only for get_attr nodes (its stub wants a Module).
    split_gm = torch.fx.passes.split_module.split_module(
        graph, None, lambda node: node_to_subgraph[node], keep_original_order=True  # type: ignore[arg-type]  # stub
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
    attr = getattr(getattr(grapharg, "source", None), "name", None)  # a str or a method
    name = attr if isinstance(attr, str) else attr() if callable(attr) else None
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

