"""Register Python kernels as torch.library ops in the "aiter" namespace.

Dynamo traces a registered op as one opaque node (its fake_impl gives shapes), which is
what lets piecewise compilation split the graph at it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.library import Library

aiter_lib = Library("aiter", "FRAGMENT")


def direct_register_custom_op(
    op_name: str,
    op_func: Callable,
    mutates_args: list[str] | None = None,
    fake_impl: Callable | None = None,
    target_lib: Library | None = None,
    dispatch_key: str | Sequence[str] = "CUDA",
    tags: tuple[torch.Tag, ...] = (),
) -> None:
    """Define `<namespace>::<op_name>` from op_func's signature and register its kernels.

    dispatch_key may name several keys ("CPU", "CUDA") for an op with one Python impl.
    """
    lib = target_lib or aiter_lib
    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args or [])
    lib.define(op_name + schema, tags=tags)
    keys = [dispatch_key] if isinstance(dispatch_key, str) else list(dispatch_key)
    for key in keys:
        lib.impl(op_name, op_func, dispatch_key=key)
    if fake_impl is not None:
        lib._register_fake(op_name, fake_impl)
