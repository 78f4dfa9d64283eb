"""The runtime tests' tiers: a test that starts processes (a runtime or router server, a CLI
run, ranks of a process group) takes seconds, so it is marked `slow` and `hack/test --fast`
leaves it out. The mark follows the code: the test, or a fixture of its module, spawns.

The tiny CPU engine the tests share is in tiny.py (`tiny_config`, `tiny_engine`).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SPAWNS = re.compile(r"\b(start_server|start_router|subprocess\.\w+|mp\.spawn|run_warmup|Proc)\(")


@cache
def _spawns(fn: Callable[..., object]) -> bool:
    try:
        return SPAWNS.search(inspect.getsource(fn)) is not None
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not isinstance(item, pytest.Function) or item.path.parent != HERE:
            continue
        module = vars(item.module)
        fixtures = [module[name] for name in item.fixturenames if callable(module.get(name))]
        if any(_spawns(fn) for fn in [item.function, *fixtures]):
            item.add_marker(pytest.mark.slow)
