"""cuda-ipc: the decode side maps the prefill's KV cache and copies the held blocks GPU -> GPU.

Prefill: the cache tensor's CUDA storage is shared once (`UntypedStorage._share_cuda_`, what
torch.multiprocessing sends for a CUDA tensor) and every offer names that export plus the held
block ids. Decode: the export is opened once per prefill peer (`_new_shared_cuda`, i.e.
cudaIpcOpenMemHandle), kept while the peer's export stays the same, and closed when the export
changes (the prefill restarted), when a copy from it fails, when more than MAX_PEERS peers are
open, or when the service closes. The held blocks are copied into a tensor on the decode's GPU
and the copy is synchronised before the ACK: the prefill frees the blocks only after it.

Both processes must share the host's IPC namespace and /dev/shm (torch keeps the handle's
reference counter there), and the decode must see the prefill's GPU (PeerFacts.visible_gpus).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from atom.disagg.kv_blocks import gather_blocks_on
from atom.disagg.negotiate import same_host_gpu_reason
from atom.disagg.peer import PeerFacts, gpu_uuids
from atom.disagg.transport import HandleCounters, ReceiveContext, TransportFailure, TransportName

logger = logging.getLogger(__name__)

MAX_PEERS = 8  # open mappings kept on a decode instance (one per prefill it pulls from)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(data: Any) -> bytes | None:
    return None if data is None else base64.b64decode(data)


@dataclass(frozen=True)
class CacheExport:
    """One shared KV cache tensor, as JSON can carry it (the handle bytes in base64)."""

    gpu_uuid: str
    handle: str
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: str | None
    ref_counter_offset: int
    event_handle: str | None
    event_sync_required: bool
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    tensor_offset: int
    dtype: str

    @property
    def key(self) -> str:
        return f"{self.handle}:{self.storage_offset_bytes}"

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["shape"], d["stride"] = list(self.shape), list(self.stride)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> CacheExport:
        if not isinstance(data, dict):
            raise ValueError("cuda-ipc offer.export must be an object")
        try:
            return cls(**{**data, "shape": tuple(data["shape"]), "stride": tuple(data["stride"])})
        except (TypeError, KeyError) as exc:
            raise ValueError(f"cuda-ipc offer.export is malformed: {exc}") from None


def export_cache(kv_cache: torch.Tensor, gpu_uuid: str) -> CacheExport:
    storage = kv_cache.untyped_storage()
    (_, handle, size, offset, ref_h, ref_off, ev_h, ev_sync) = storage._share_cuda_()
    return CacheExport(
        gpu_uuid=gpu_uuid,
        handle=_b64(handle) or "",
        storage_bytes=int(size),
        storage_offset_bytes=int(offset),
        ref_counter_handle=_b64(ref_h),
        ref_counter_offset=int(ref_off),
        event_handle=_b64(ev_h),
        event_sync_required=bool(ev_sync),
        shape=tuple(kv_cache.shape),
        stride=tuple(kv_cache.stride()),
        tensor_offset=int(kv_cache.storage_offset()),
        dtype=str(kv_cache.dtype).removeprefix("torch."),
    )


def open_export(export: CacheExport, device_index: int) -> torch.Tensor:
    """The prefill's cache as a tensor of this process, on its ordinal for that GPU."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        device_index,
        _unb64(export.handle),
        export.storage_bytes,
        export.storage_offset_bytes,
        _unb64(export.ref_counter_handle),
        export.ref_counter_offset,
        _unb64(export.event_handle),
        export.event_sync_required,
    )
    t = torch.empty(0, dtype=getattr(torch, export.dtype), device=f"cuda:{device_index}")
    return t.set_(storage, export.tensor_offset, export.shape, export.stride)


class PeerMappings:
    """The decode side's open mappings, one per prefill export (pure bookkeeping: `opener`
    does the CUDA part). Reused while a peer's export stays the same; closed when the peer at
    that address offers another export (it restarted), when `drop`ped after a failed copy,
    past `max_peers` (least recently used first), and at `close`."""

    def __init__(self, opener: Callable[[CacheExport], Any], max_peers: int = MAX_PEERS) -> None:
        self._opener, self.max_peers = opener, max_peers
        self.counters = HandleCounters()
        self._open: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._by_peer: dict[str, str] = {}  # prefill KV address -> its export's key
        self._lock = threading.Lock()  # pulls copy on executor threads, several at a time

    def get(self, address: str, export: CacheExport) -> Any:
        """The mapped cache; the caller's reference keeps it valid through a concurrent close."""
        with self._lock:
            old = self._by_peer.get(address)
            self._by_peer[address] = export.key
            if old is not None and old != export.key and old not in self._by_peer.values():
                self._close_locked(old)
            mapped = self._open.get(export.key)
            if mapped is not None:
                self._open.move_to_end(export.key)
                return mapped
            mapped = self._opener(export)
            self._open[export.key] = mapped
            self.counters.opened += 1
            while len(self._open) > self.max_peers:
                self._close_locked(next(iter(self._open)))
            return mapped

    def drop(self, key: str) -> None:
        with self._lock:
            self._close_locked(key)

    def close(self) -> None:
        with self._lock:
            for key in list(self._open):
                self._close_locked(key)

    def _close_locked(self, key: str) -> None:
        if self._open.pop(key, None) is not None:
            self.counters.closed += 1  # the storage's last reference: torch closes the handle
        self._by_peer = {a: k for a, k in self._by_peer.items() if k != key}


class CudaIpcTransport:
    name = TransportName.CUDA_IPC

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mappings = PeerMappings(self._open_here)
        self.counters = self.mappings.counters  # decode: mappings opened / closed
        self.exports = HandleCounters()  # prefill: the cache shared (once) / unshared
        self._export: CacheExport | None = None

    def why_unavailable(self, local: PeerFacts) -> str | None:
        if self.device.type != "cuda" or local.gpu_uuid is None:
            return "the KV cache is not on a GPU"
        return None

    def why_unreachable(self, local: PeerFacts, peer: PeerFacts) -> str | None:
        return same_host_gpu_reason(self.name, local, peer)

    # ---- prefill ------------------------------------------------------------------------------
    async def export(self, kv_cache: Any, block_ids: list[int], peer: PeerFacts) -> dict[str, Any]:
        if self._export is None:
            uuids = gpu_uuids()
            try:
                self._export = export_cache(kv_cache, uuids[kv_cache.device.index or 0])
            except (RuntimeError, IndexError) as exc:
                raise TransportFailure(self.name, f"sharing the KV cache failed: {exc}") from None
            self.exports.opened += 1
        return {"export": self._export.to_dict(), "block_ids": list(block_ids)}

    async def send(self, kv_cache: Any, block_ids: list[int], offer: dict[str, Any]) -> None:
        return None  # the decode reads the blocks itself

    # ---- decode -------------------------------------------------------------------------------
    async def receive(self, offer: dict[str, Any], ctx: ReceiveContext) -> Any:
        try:
            export = CacheExport.from_dict(offer.get("export"))
            ids = [int(b) for b in offer.get("block_ids", [])]
        except (ValueError, TypeError) as exc:
            raise TransportFailure(self.name, str(exc)) from None
        if len(ids) != ctx.num_blocks:
            raise TransportFailure(
                self.name, f"offer names {len(ids)} blocks, not {ctx.num_blocks}"
            )
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self._copy, ctx.address, export, ids)
        except (RuntimeError, ValueError, IndexError) as exc:
            self.mappings.drop(export.key)  # a stale or broken mapping is not reused
            raise TransportFailure(self.name, f"copy from the mapped cache failed: {exc}") from None

    def _open_here(self, export: CacheExport) -> torch.Tensor:
        uuids = gpu_uuids()
        if export.gpu_uuid not in uuids:
            raise ValueError(f"GPU {export.gpu_uuid} is not visible to this process")
        return open_export(export, uuids.index(export.gpu_uuid))

    def _copy(self, address: str, export: CacheExport, ids: list[int]) -> torch.Tensor:
        remote = self.mappings.get(address, export)
        with torch.cuda.device(self.device):
            out = gather_blocks_on(remote, ids, self.device)
            # Every byte is here before the ACK lets the prefill free (and reuse) the blocks.
            torch.cuda.synchronize(self.device)
            torch.cuda.synchronize(remote.device)
        return out

    def close(self) -> None:
        self.mappings.close()
        if self._export is not None:
            self._export = None
            self.exports.closed += 1
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # release what consumers returned (producer side)
