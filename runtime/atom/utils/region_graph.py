"""Placeholder: replaced by the CUDA-graph engine (TokenGraph, ReqGraph)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def eager_region(fn: F) -> F:
    """Marks an op that runs eagerly between token-graph segments (pass-through for now)."""
    return fn
