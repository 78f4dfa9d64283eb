"""The decode side of a transfer: pull a handle's blocks into host memory (or release them).

One attempt is one connection, bounded by `timeout` overall and `io_timeout` per read or write.
A transport failure (refused, reset, cut short, silent) is retried once; a refusal (unknown
handle, mismatch, version) is final. Every failure is a KVTransferError whose message names the
prefill's address and the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from atom.disagg import wire
from atom.disagg.handle import KVHandle
from atom.disagg.kv_blocks import as_bytes, new_staging
from atom.disagg.layout import KVLayout
from atom.wire import errors as codes

logger = logging.getLogger(__name__)

_TRANSPORT_ERRORS = (OSError, TimeoutError)  # TransferCut is a ConnectionError


class KVTransferError(Exception):
    def __init__(self, message: str, code: str = codes.KV_TRANSFER_FAILED, retryable: bool = False):
        super().__init__(message)
        self.message, self.code, self.retryable = message, code, retryable


@dataclass
class PulledKV:
    blocks: torch.Tensor  # host, [n, 2, layers, block, heads, dim]
    num_tokens: int
    seconds: float
    attempts: int

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()


async def pull_kv(
    handle: KVHandle,
    layout: KVLayout,
    *,
    timeout: float = 30.0,
    io_timeout: float = 10.0,
    retries: int = 1,
    metrics: Any = None,
) -> PulledKV:
    t0 = time.perf_counter()
    attempt = 0
    while True:
        attempt += 1
        try:
            async with asyncio.timeout(timeout):
                blocks = await _pull_once(handle, layout, io_timeout)
        except KVTransferError:
            _count(metrics, "refused")
            raise
        except (*_TRANSPORT_ERRORS, wire.WireError) as exc:
            cause = _describe(exc)
            if attempt <= retries and not isinstance(exc, wire.WireError):
                logger.warning("KV pull from %s failed (%s); retrying", handle.address, cause)
                _count(metrics, "retried")
                continue
            _count(metrics, "failed")
            raise KVTransferError(
                f"KV transfer from {handle.address} failed after {attempt} attempt(s): {cause}"
            ) from None
        seconds = time.perf_counter() - t0
        pulled = PulledKV(blocks, len(handle.prompt_token_ids), seconds, attempt)
        if metrics is not None:
            metrics.observe("received", pulled.nbytes, blocks.shape[0], seconds)
            metrics.outcome("received", "ok")
        return pulled


async def release_kv(handle: KVHandle, layout: KVLayout, timeout: float = 5.0) -> bool:
    """Best effort: tell the prefill instance its blocks are not needed. True if it freed them."""
    try:
        conn = await wire.SocketConn.open(handle.kv_host or "", handle.kv_port, timeout)
        try:
            await conn.write_frame(wire.RELEASE, _request(handle, layout))
            _, kind, _ = await conn.read_frame()
            return kind == wire.DONE
        finally:
            conn.close()
    except (*_TRANSPORT_ERRORS, wire.WireError) as exc:
        logger.info("KV release at %s failed: %s (the hold times out)", handle.address, exc)
        return False


def _request(handle: KVHandle, layout: KVLayout) -> dict[str, Any]:
    return {"handle": handle.handle, "secret": handle.secret, "layout": layout.to_dict()}


def _count(metrics: Any, outcome: str) -> None:
    if metrics is not None:
        metrics.outcome("received", outcome)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


async def _pull_once(handle: KVHandle, layout: KVLayout, io_timeout: float) -> torch.Tensor:
    conn = await wire.SocketConn.open(handle.kv_host or "", handle.kv_port, io_timeout)
    try:
        await conn.write_frame(wire.PULL, _request(handle, layout))
        version, kind, head = await conn.read_frame()
        if version != wire.WIRE_VERSION:
            raise KVTransferError(
                f"the prefill instance at {handle.address} speaks KV wire version {version}, "
                f"this decode instance version {wire.WIRE_VERSION}",
                code=codes.KV_VERSION_MISMATCH,
            )
        if kind != wire.OK:
            name = wire.ERROR_NAMES.get(kind, str(kind))
            message = head.get("message", name)
            raise KVTransferError(
                f"the prefill instance at {handle.address} refused: {message}", code=f"kv_{name}"
            )
        blocks = _check_header(handle, layout, head)
        await conn.recv_into(as_bytes(blocks))  # straight into the staging tensor
        await conn.write_frame(wire.ACK, {})
        with contextlib.suppress(*_TRANSPORT_ERRORS, wire.WireError):
            await conn.read_frame()  # DONE: the prefill freed the blocks
        return blocks
    finally:
        conn.close()


def _check_header(handle: KVHandle, layout: KVLayout, head: dict[str, Any]) -> torch.Tensor:
    """Refuse before reading a block: the peer's layout and the block count must match ours."""
    try:
        theirs = KVLayout.from_dict(head.get("layout"))
    except ValueError as exc:
        raise wire.WireError(f"bad OK header: {exc}") from None
    why = layout.mismatch(theirs, mine="this decode instance", theirs="the prefill instance")
    if why:
        raise KVTransferError(f"refusing KV blocks from {handle.address}: {why}",
                              code=codes.KV_MISMATCH)  # fmt: skip
    n, tokens = head.get("num_blocks"), head.get("num_tokens")
    if (
        n != handle.num_blocks
        or tokens != len(handle.prompt_token_ids)
        or n != layout.blocks_for(tokens)
    ):
        raise KVTransferError(
            f"the prefill instance at {handle.address} offers {n} blocks for {tokens} tokens; "
            f"the handle says {handle.num_blocks} blocks for {len(handle.prompt_token_ids)}",
            code=codes.KV_BAD_REQUEST,
        )
    return new_staging(layout, n)
