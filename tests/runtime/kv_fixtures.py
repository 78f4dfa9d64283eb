"""Shared pieces of the KV transfer tests: a small cache, a handle for it, a KV server on it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import torch

from atom.disagg.handle import KVHandle
from atom.disagg.holds import KVHoldRegistry
from atom.disagg.layout import KVLayout
from atom.disagg.registry import TransportSet
from atom.disagg.server import KVServer, KVSource

SHAPE = (2, 3, 9, 4, 2, 8)  # [k/v, layers, blocks + 1, block_size, kv_heads, head_dim]


def make_cache(seed: int = 0) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def handle_for(name: str, layout: KVLayout, port: int, tokens: int) -> KVHandle:
    return KVHandle(
        handle=name,
        kv_host="127.0.0.1",
        kv_port=port,
        identity=layout.identity,
        model=layout.model,
        num_blocks=layout.blocks_for(tokens),
        prompt_token_ids=list(range(1, tokens + 1)),
        first_token_id=7,
    )


@contextlib.asynccontextmanager
async def kv_server(
    cache: torch.Tensor,
    holds: KVHoldRegistry,
    layout: KVLayout,
    transports: TransportSet | None = None,
    **kw: Any,
) -> AsyncIterator[KVServer]:
    """A prefill side's KV server on 127.0.0.1 (transports None: TCP only)."""
    server = KVServer(lambda: KVSource(layout, holds, cache, transports=transports), **kw)
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.close()
