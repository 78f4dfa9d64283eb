"""nccl: the prefill sends the held blocks GPU -> GPU with NCCL send/recv between the two processes.

A two-rank group per (prefill, decode) pair, set up on demand and kept for later pulls: the
prefill (rank 0) hosts a TCPStore on an ephemeral port of its KV bind address and names it in
the offer; the decode (rank 1) joins it at the prefill's KV host. The group is built directly
(ProcessGroupNCCL over a PrefixStore), outside torch.distributed's default group, so it does not
touch the tensor-parallel group. The prefill gathers the blocks into one contiguous tensor on
its GPU and sends it; the decode receives into a tensor on its own GPU and synchronises before
the ACK. A group whose send or receive failed is closed (and made anew at the next pull).

Written for two GPUs of one host; not exercised by the CPU tests (tests/runtime/
test_kv_transport.py has a GPU-marked test).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import torch

from atom.disagg.kv_blocks import gather_blocks_on, new_staging
from atom.disagg.negotiate import same_host_gpu_reason
from atom.disagg.peer import PeerFacts
from atom.disagg.transport import HandleCounters, ReceiveContext, TransportFailure, TransportName

logger = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 30.0
MAX_PEERS = 8


@dataclass
class _Group:
    store: Any  # torch.distributed.TCPStore (rank 0 keeps it listening)
    pg: Any  # ProcessGroupNCCL of world 2
    tag: str


def _new_group(store: Any, tag: str, rank: int) -> Any:
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    return dist.ProcessGroupNCCL(dist.PrefixStore(tag, store), rank, 2, opts)


class NcclTransport:
    name = TransportName.NCCL

    def __init__(self, device: torch.device, bind_host: str) -> None:
        self.device, self.bind_host = device, bind_host
        self.counters = HandleCounters()  # groups formed / closed, either side
        self._serving: dict[str, _Group] = {}  # prefill: by decode peer
        self._joined: dict[str, _Group] = {}  # decode: by prefill store

    def why_unavailable(self, local: PeerFacts) -> str | None:
        import torch.distributed as dist

        if self.device.type != "cuda" or local.gpu_uuid is None:
            return "the KV cache is not on a GPU"
        if not (dist.is_available() and dist.is_nccl_available()):
            return "this torch has no NCCL"
        return None

    def why_unreachable(self, local: PeerFacts, peer: PeerFacts) -> str | None:
        return same_host_gpu_reason(self.name, local, peer)

    # ---- prefill (rank 0) ---------------------------------------------------------------------
    async def export(self, kv_cache: Any, block_ids: list[int], peer: PeerFacts) -> dict[str, Any]:
        import torch.distributed as dist

        key = f"{peer.host_id}:{peer.pid}"
        group = self._serving.get(key)
        if group is None:
            tag = secrets.token_hex(8)
            try:
                store = dist.TCPStore(self.bind_host, 0, 2, True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))  # fmt: skip
                group = _Group(store, _new_group(store, tag, 0), tag)
            except (RuntimeError, ValueError) as exc:
                raise TransportFailure(self.name, f"NCCL group setup failed: {exc}") from None
            self._serving[key] = group
            self.counters.opened += 1
            self._trim(self._serving)
        return {"store_port": group.store.port, "group": group.tag, "peer": key}

    async def send(self, kv_cache: Any, block_ids: list[int], offer: dict[str, Any]) -> None:
        key = offer["peer"]
        group = self._serving[key]

        def run() -> None:
            try:
                buf = gather_blocks_on(kv_cache, block_ids, kv_cache.device)
                group.pg.send([buf], 1, 0).wait()
                torch.cuda.synchronize(kv_cache.device)
            except (RuntimeError, ValueError) as exc:
                # Closed here, in the thread: the awaiting server may have moved on (FALLBACK).
                self._close(self._serving, key)
                raise TransportFailure(self.name, f"NCCL send failed: {exc}") from None

        await asyncio.get_running_loop().run_in_executor(None, run)

    # ---- decode (rank 1) ----------------------------------------------------------------------
    async def receive(self, offer: dict[str, Any], ctx: ReceiveContext) -> Any:
        port, tag = offer.get("store_port"), offer.get("group")
        if not isinstance(port, int) or not isinstance(tag, str):
            raise TransportFailure(self.name, "offer lacks store_port / group")
        key = f"{ctx.kv_host}:{port}:{tag}"

        def run() -> torch.Tensor:
            group = self._join(key, ctx.kv_host, port, tag)
            buf = new_staging(ctx.layout, ctx.num_blocks, str(self.device))
            group.pg.recv([buf], 0, 0).wait()
            torch.cuda.synchronize(self.device)  # every byte is here before the ACK
            return buf

        try:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        except (RuntimeError, ValueError) as exc:
            self._close(self._joined, key)
            raise TransportFailure(self.name, f"NCCL receive failed: {exc}") from None

    def _join(self, key: str, host: str, port: int, tag: str) -> _Group:
        import torch.distributed as dist

        group = self._joined.get(key)
        if group is None:
            store = dist.TCPStore(host, port, 2, False,
                                  timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))  # fmt: skip
            group = _Group(store, _new_group(store, tag, 1), tag)
            self._joined[key] = group
            self.counters.opened += 1
            self._trim(self._joined)
        return group

    # ---- closing ------------------------------------------------------------------------------
    def _trim(self, groups: dict[str, _Group]) -> None:
        while len(groups) > MAX_PEERS:
            self._close(groups, next(iter(groups)))

    def _close(self, groups: dict[str, _Group], key: str) -> None:
        group = groups.pop(key, None)
        if group is None:
            return
        self.counters.closed += 1
        for name in ("abort", "shutdown"):  # torch >= 2.3; older ones free it with the object
            fn = getattr(group.pg, name, None)
            if fn is not None:
                try:
                    fn()
                except RuntimeError:
                    logger.debug("NCCL group %s: %s failed", group.tag, name, exc_info=True)
                break

    def close(self) -> None:
        for groups in (self._serving, self._joined):
            for key in list(groups):
                self._close(groups, key)
