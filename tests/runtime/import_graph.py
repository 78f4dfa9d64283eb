"""The module-level import graph of the project's packages, read from the source with `ast`.

Every import counts: top-level, inside a function (lazy) and under `if TYPE_CHECKING:`, since
each one ties the two modules together even when Python does not run it at import time.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Source roots -> the top-level packages under them that the graph covers.
PACKAGES = {
    REPO / "runtime": "atom",
    REPO / "operator": "atom_operator",
    REPO / "devtools": "atom_devtools",
}


@dataclass(frozen=True)
class Import:
    """One `import` statement's target, as the importing module sees it."""

    line: int
    module: str  # the imported module (resolved: relative imports made absolute)
    name: str | None  # `from module import name`; None for `import module`
    asname: str | None = None


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    tree: ast.Module = field(repr=False)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def load(roots: dict[Path, str] = PACKAGES) -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for root, top in roots.items():
        for path in sorted((root / top).rglob("*.py")):
            name, is_package = module_name(root, path)
            tree = ast.parse(path.read_text(), str(path))
            modules[name] = Module(name, path, is_package, tree)
    return modules


def load_files(paths: Iterable[Path], root: Path) -> dict[str, Module]:
    """Loose scripts (bench/*.py) under `root`, named by their path."""
    out = {}
    for path in paths:
        name, is_package = module_name(root, path)
        out[name] = Module(name, path, is_package, ast.parse(path.read_text(), str(path)))
    return out


def imports(module: Module) -> Iterator[Import]:
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, None, alias.asname)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield Import(node.lineno, base, alias.name, alias.asname)


def target(imp: Import, modules: dict[str, Module]) -> str | None:
    """The project module an import reaches: `from p import m` reaches p.m when m is a module,
    else p itself; None outside the graph (stdlib, third party)."""
    if imp.name and f"{imp.module}.{imp.name}" in modules:
        return f"{imp.module}.{imp.name}"
    return imp.module if imp.module in modules else None


def edges(modules: dict[str, Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, module in modules.items():
        for imp in imports(module):
            to = target(imp, modules)
            if to and to != name:
                graph[name].add(to)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        # Iterative: the graph is deep enough to reach Python's recursion limit.
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(found)


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(module: Module, modules: dict[str, Module]) -> Iterator[str]:
    """`from x import _y` and `x._y` where x is another project module: `line: what`."""
    aliases: dict[str, str] = {}  # local name -> project module it is bound to
    for imp in imports(module):
        to = target(imp, modules)
        if to is None or to == module.name:
            continue
        if imp.name is None:
            if imp.asname:
                aliases[imp.asname] = to  # `import a.b as m`; plain `import a.b` binds `a`
        elif to == f"{imp.module}.{imp.name}":
            aliases[imp.asname or imp.name] = to  # a module imported by name
        elif is_private(imp.name):
            yield f"{imp.line}: from {imp.module} import {imp.name}"
    for node in ast.walk(module.tree):
        if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
            continue
        dotted = _dotted(node.value)
        if dotted is None:
            continue
        head, _, rest = dotted.partition(".")
        base = aliases.get(head, head if head in PACKAGES.values() else "")
        owner = ".".join(p for p in (base, rest) if p)
        if owner in modules and owner != module.name:
            yield f"{node.lineno}: {dotted}.{node.attr}"


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return f"{inner}.{node.attr}" if inner else None
    return None


def is_reexport(module: Module) -> bool:
    """A module whose body only imports and re-binds names: an old path kept for callers."""
    if module.is_package:
        return False
    body = [s for s in module.tree.body
            if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if not body:
        return False
    for stmt in body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            continue
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Name | ast.List | ast.Tuple):
            continue  # `Alias = Name` and `__all__ = [...]`
        return False
    return any(isinstance(s, ast.ImportFrom) and s.module and s.module.startswith("atom")
               for s in body)
