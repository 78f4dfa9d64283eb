"""The runtime tests' tiers: a test that starts processes (a runtime or router server, a CLI
run, ranks of a process group) takes seconds, so it is marked `slow` and `hack/test --fast`
leaves it out. The mark follows the code: the test, or a fixture of its module, spawns, directly
or through a helper function of these test modules (server_proc.healthy_server, a module's
run_worker) that it calls.

The tiny CPU engine the tests share is in tiny.py (`tiny_config`, `tiny_engine`).
"""

from __future__ import annotations

import inspect
import re
from functools import cache
from pathlib import Path
from types import FunctionType

import pytest

HERE = Path(__file__).resolve().parent
SPAWNS = re.compile(r"\b(start_server|start_router|subprocess\.\w+|mp\.spawn|run_warmup|Proc)\(")
CALL = re.compile(r"\b([A-Za-z_]\w*)\(")


def _source(fn: FunctionType) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return ""


def _helpers(fn: FunctionType, source: str) -> list[FunctionType]:
    """The functions of these test modules that fn's source calls by name."""
    found = (fn.__globals__.get(name) for name in CALL.findall(source))
    return [f for f in found if isinstance(f, FunctionType)
            and Path(f.__code__.co_filename).resolve().parent == HERE]


@cache
def _spawns(fn: FunctionType) -> bool:
    seen: set[FunctionType] = set()
    todo = [fn]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        source = _source(f)
        if SPAWNS.search(source):
            return True
        todo.extend(_helpers(f, source))
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function) or item.path.parent != HERE:
            continue
        module = vars(item.module)
        fixtures = [module[name] for name in item.fixturenames if callable(module.get(name))]
        functions = [inspect.unwrap(fn) for fn in [item.function, *fixtures]]
        if any(_spawns(fn) for fn in functions if isinstance(fn, FunctionType)):
            item.add_marker(pytest.mark.slow)
