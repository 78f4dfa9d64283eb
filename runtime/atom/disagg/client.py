"""The decode side of a transfer: pull a handle's blocks (or release them).

One attempt is one connection, bounded by `timeout` overall and `io_timeout` per read or write.
The PULL offers this instance's transports (registry.py); the prefill's OK names the one it
chose. A fast path that fails under `auto` falls back to TCP on the same connection (FALLBACK);
under a forced transport it is a broken attempt. A broken attempt (refused, reset, cut short,
silent, fast path failed) is retried once, without the fast paths that failed; a refusal
(unknown handle, mismatch, version, no common transport) is final. Every failure is a
KVTransferError whose message names the prefill's address, the transport and the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from atom.disagg import wire
from atom.disagg.handle import KVHandle
from atom.disagg.kv_blocks import as_bytes, new_staging
from atom.disagg.layout import KVLayout
from atom.disagg.metrics import count_transport
from atom.disagg.negotiate import Offer
from atom.disagg.registry import TransportSet
from atom.disagg.transport import (
    ReceiveContext,
    TransferReport,
    TransportFailure,
    TransportName,
)
from atom.wire import errors as codes

logger = logging.getLogger(__name__)

_TRANSPORT_ERRORS = (OSError, TimeoutError)  # TransferCut is a ConnectionError


class KVTransferError(Exception):
    def __init__(self, message: str, code: str = codes.KV_TRANSFER_FAILED, retryable: bool = False):
        super().__init__(message)
        self.message, self.code, self.retryable = message, code, retryable


@dataclass
class PulledKV:
    blocks: torch.Tensor  # [n, 2, layers, block, heads, dim]: host (tcp) or this GPU (fast)
    num_tokens: int
    seconds: float
    attempts: int
    report: TransferReport = field(default_factory=TransferReport)

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
    transports: TransportSet | None = None,
) -> PulledKV:
    """transports: None pulls as a handshake-1 decode (TCP, no offer)."""
    t0 = time.perf_counter()
    attempt = 0
    skip: set[TransportName] = set()  # fast paths that failed during this pull
    while True:
        attempt += 1
        report = TransferReport()
        try:
            async with asyncio.timeout(timeout):
                blocks = await _pull_once(handle, layout, io_timeout, transports, skip, report)
        except KVTransferError:
            _count(metrics, "refused", report.transport)
            raise
        except (*_TRANSPORT_ERRORS, wire.WireError, TransportFailure) as exc:
            cause = _describe(exc)
            if attempt <= retries and not isinstance(exc, wire.WireError):
                logger.warning("KV pull from %s over %s failed (%s); retrying", handle.address,
                               report.transport, cause)  # fmt: skip
                _count(metrics, "retried", report.transport)
                continue
            _count(metrics, "failed", report.transport)
            raise KVTransferError(
                f"KV transfer from {handle.address} failed after {attempt} attempt(s) over "
                f"{report.transport}: {cause}"
            ) from None
        seconds = time.perf_counter() - t0
        pulled = PulledKV(blocks, len(handle.prompt_token_ids), seconds, attempt, report)
        logger.info("KV pull of %s from %s: %d blocks, %.1f MiB in %.1f ms over %s (attempt %d)",
                    handle.handle[:40], handle.address, blocks.shape[0], pulled.nbytes / 2**20,
                    seconds * 1e3, report.describe(), attempt)  # fmt: skip
        if metrics is not None:
            metrics.observe("received", pulled.nbytes, blocks.shape[0], seconds)
            metrics.outcome("received", "ok")
            count_transport(metrics, "received", str(report.transport), "ok", seconds)
            if report.fallback_from is not None:
                count_transport(metrics, "received", str(report.fallback_from), "fallback")
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


def _count(metrics: Any, outcome: str, transport: TransportName) -> None:
    if metrics is not None:
        metrics.outcome("received", outcome)
        count_transport(metrics, "received", str(transport), outcome)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


async def _pull_once(
    handle: KVHandle,
    layout: KVLayout,
    io_timeout: float,
    transports: TransportSet | None,
    skip: set[TransportName],
    report: TransferReport,
) -> torch.Tensor:
    offer = transports.offer(frozenset(skip)) if transports is not None else None
    if offer is not None and not offer.accept:  # a forced transport this instance lacks
        assert transports is not None and transports.mode.forced is not None
        why = transports.why_unavailable(transports.mode.forced)
        raise KVTransferError(
            f"cannot pull from {handle.address}: --kv-transport {transports.mode} is not usable "
            f"on this decode instance ({why})"
        )
    report.transport = offer.accept[0] if offer is not None else TransportName.TCP
    conn = await wire.SocketConn.open(handle.kv_host or "", handle.kv_port, io_timeout)
    try:
        body = _request(handle, layout)
        if offer is not None:
            body["transport"] = offer.to_dict()
        await conn.write_frame(wire.PULL, body)
        head = await _read_ok(conn, handle, offer)
        num_blocks = _check_header(handle, layout, head)
        name = _chosen(handle, head, offer, report)
        blocks: torch.Tensor | None = None
        if name != TransportName.TCP:
            assert transports is not None and offer is not None
            blocks = await _receive_fast(conn, handle, layout, num_blocks, head, name,
                                         transports, offer, skip, report)  # fmt: skip
        if blocks is None:  # TCP: the bytes follow the OK, straight into the staging tensor
            blocks = new_staging(layout, num_blocks)
            await conn.recv_into(as_bytes(blocks))
        await conn.write_frame(wire.ACK, {})
        with contextlib.suppress(*_TRANSPORT_ERRORS, wire.WireError):
            await conn.read_frame()  # DONE: the prefill freed the blocks
        return blocks
    finally:
        conn.close()


async def _read_ok(conn: wire.SocketConn, handle: KVHandle, offer: Offer | None) -> dict[str, Any]:
    version, kind, head = await conn.read_frame()
    if version != wire.WIRE_VERSION:
        raise KVTransferError(
            f"the prefill instance at {handle.address} speaks KV wire version {version}, "
            f"this decode instance version {wire.WIRE_VERSION}",
            code=codes.KV_VERSION_MISMATCH,
        )
    if kind == wire.TRANSPORT_REFUSED:  # a 503 kv_transfer_failed naming the transports
        offered = ", ".join(offer.accept) if offer is not None else "tcp"
        raise KVTransferError(
            f"the prefill instance at {handle.address} refused KV transport(s) {offered}: "
            f"{head.get('message', 'refused')}"
        )
    if kind != wire.OK:
        name = wire.ERROR_NAMES.get(kind, str(kind))
        message = head.get("message", name)
        raise KVTransferError(
            f"the prefill instance at {handle.address} refused: {message}", code=f"kv_{name}"
        )
    return head


def _chosen(
    handle: KVHandle, head: dict[str, Any], offer: Offer | None, report: TransferReport
) -> TransportName:
    """The transport the OK names (a handshake-1 prefill names none: TCP), checked against the
    offer; a faster one offered and refused is recorded as the fallback."""
    raw = head.get("transport", "tcp")
    try:
        name = TransportName(raw)
    except ValueError:
        raise wire.WireError(f"the prefill chose an unknown KV transport {raw!r}") from None
    accepted = offer.accept if offer is not None else (TransportName.TCP,)
    if name not in accepted:
        if "transport" not in head:  # an old prefill: it can only send TCP
            raise KVTransferError(
                f"the prefill instance at {handle.address} predates KV transports (TCP only); "
                f"this decode instance offers {', '.join(accepted)}"
            )
        raise wire.WireError(f"the prefill chose KV transport {name}, which was not offered")
    report.transport = name
    refused = head.get("refused")
    if offer is not None and name != offer.accept[0]:
        why = refused.get(offer.accept[0]) if isinstance(refused, dict) else None
        if "transport" not in head:
            why = "the prefill instance predates KV transports (handshake 1)"
        report.fallback_from = offer.accept[0]
        report.fallback_reason = str(why or "not chosen by the prefill instance")[:300]
    return name


async def _receive_fast(
    conn: wire.SocketConn,
    handle: KVHandle,
    layout: KVLayout,
    num_blocks: int,
    head: dict[str, Any],
    name: TransportName,
    transports: TransportSet,
    offer: Offer,
    skip: set[TransportName],
    report: TransferReport,
) -> torch.Tensor | None:
    """The blocks over the fast transport; None once the prefill was asked to send them over TCP
    instead (the TCP OK header is read and checked here). TransportFailure when forced."""
    ctx = ReceiveContext(layout, num_blocks, handle.kv_host or "", handle.address)
    offered = head.get("offer")
    try:
        if not isinstance(offered, dict):
            raise TransportFailure(name, "the OK carries no offer")
        return await transports.get(name).receive(offered, ctx)
    except TransportFailure as exc:
        logger.warning("KV transport %s from %s failed: %s", name, handle.address, exc.cause)
        if TransportName.TCP not in offer.accept:
            raise  # forced: a broken attempt, retried over the same transport
        skip.add(name)  # the retry, if any, goes straight to what is left
        report.fallback_from, report.fallback_reason = name, exc.cause[:300]
        await conn.write_frame(wire.FALLBACK, {"reason": exc.cause[:300]})
    head = await _read_ok(conn, handle, offer)
    if _check_header(handle, layout, head) != num_blocks or head.get("transport") != "tcp":
        raise wire.WireError("the prefill's TCP fallback does not match its first offer")
    report.transport = TransportName.TCP
    return None


def _check_header(handle: KVHandle, layout: KVLayout, head: dict[str, Any]) -> int:
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
    return n
