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


class CudaIpcTransport:
    name = TransportName.CUDA_IPC

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counters = HandleCounters()  # decode: mappings opened / closed
        self.exports = HandleCounters()  # prefill: the cache shared (once) / unshared
        self._export: CacheExport | None = None
        self._open: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()

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
            return await loop.run_in_executor(None, self._copy, export, ids)
        except (RuntimeError, ValueError, IndexError) as exc:
            self._close(export.key)  # a stale or broken mapping is not reused
            raise TransportFailure(self.name, f"copy from the mapped cache failed: {exc}") from None

    def _copy(self, export: CacheExport, ids: list[int]) -> torch.Tensor:
        remote = self._mapping(export)
        out = gather_blocks_on(remote, ids, self.device)
        torch.cuda.synchronize(self.device)  # every byte is here before the ACK frees them
        return out

    def _mapping(self, export: CacheExport) -> torch.Tensor:
        remote = self._open.get(export.key)
        if remote is not None:
            self._open.move_to_end(export.key)
            return remote
        uuids = gpu_uuids()
        if export.gpu_uuid not in uuids:
            raise ValueError(f"GPU {export.gpu_uuid} is not visible to this process")
        remote = open_export(export, uuids.index(export.gpu_uuid))
        self._open[export.key] = remote
        self.counters.opened += 1
        while len(self._open) > MAX_PEERS:
            self._close(next(iter(self._open)))
        return remote

    def _close(self, key: str) -> None:
        if self._open.pop(key, None) is not None:
            self.counters.closed += 1  # the storage's last reference: torch closes the handle

    def close(self) -> None:
        for key in list(self._open):
            self._close(key)
        if self._export is not None:
            self._export = None
            self.exports.closed += 1
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # release what consumers returned (producer side)
