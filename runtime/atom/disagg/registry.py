"""An instance's transports: its --kv-transport mode, its PeerFacts and the fast transports it
built, asked by the server (prefill) and the puller (decode).

TCP is always there and needs no object: its bytes ride the control connection (server.py,
client.py). The fast ones are built only where CUDA is (`build_transports`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from atom.disagg.negotiate import Decision, Offer, auto_nccl_reason, local_accept, negotiate
from atom.disagg.peer import INSTANCE, PeerFacts
from atom.disagg.transport import (
    FAST,
    KVTransport,
    TransportMode,
    TransportName,
)

logger = logging.getLogger(__name__)


class TransportUnavailable(ValueError):
    """A forced --kv-transport this instance cannot use (raised at start-up)."""


@dataclass
class TransportSet:
    mode: TransportMode
    local: PeerFacts
    fast: Mapping[TransportName, KVTransport] = field(default_factory=dict)

    def why_unavailable(self, name: TransportName) -> str | None:
        if name == TransportName.TCP:
            return None
        transport = self.fast.get(name)
        if transport is None:
            return "not built on this instance (no CUDA)"
        return transport.why_unavailable(self.local)

    def check_start(self) -> None:
        """TransportUnavailable when the forced transport cannot work here at all."""
        forced = self.mode.forced
        if forced is None:
            return
        why = self.why_unavailable(forced)
        if why is not None:
            raise TransportUnavailable(f"--kv-transport {forced} cannot be used here: {why}")

    # ---- decode side --------------------------------------------------------------------------
    def offer(self, skip: frozenset[TransportName] = frozenset()) -> Offer:
        """What the decode side offers (less `skip`: fast paths that failed this pull)."""
        reasons = {t: self.why_unavailable(t) for t in (*FAST, TransportName.TCP)}
        accept = tuple(t for t in local_accept(self.mode, reasons) if t not in skip)
        return Offer(accept, self.local)

    # ---- prefill side -------------------------------------------------------------------------
    def decide(self, offer: Offer | None) -> Decision:
        return negotiate(self.mode, offer, self._why_unreachable)

    def _why_unreachable(self, name: TransportName, peer: PeerFacts) -> str | None:
        why = self.why_unavailable(name)
        if why is not None or name == TransportName.TCP:
            return why
        why = self.fast[name].why_unreachable(self.local, peer)
        if why is None and self.mode.forced is None:
            why = auto_nccl_reason(name, self.local, peer)
        return why

    def get(self, name: TransportName) -> KVTransport:
        return self.fast[name]

    def close(self) -> None:
        for transport in self.fast.values():
            try:
                transport.close()
            except Exception:  # closing is best effort at exit; the counters tell
                logger.warning("closing KV transport %s failed", transport.name, exc_info=True)


def build_transports(mode: TransportMode, kv_cache: Any, bind_host: str) -> TransportSet:
    """The transports of an instance whose KV cache is `kv_cache` (torch tensor)."""
    from atom.disagg.peer import local_facts

    local = local_facts(kv_cache.device)
    fast: dict[TransportName, KVTransport] = {}
    if kv_cache.device.type == "cuda":
        from atom.disagg.cuda_ipc import CudaIpcTransport
        from atom.disagg.nccl import NcclTransport

        fast[TransportName.CUDA_IPC] = CudaIpcTransport(kv_cache.device)
        fast[TransportName.NCCL] = NcclTransport(kv_cache.device, bind_host)
    return TransportSet(mode, local, fast)


@functools.cache
def tcp_only() -> TransportSet:
    """What an instance without fast transports (no CUDA, or tests) negotiates with: TCP."""
    from atom.disagg.peer import host_id

    return TransportSet(TransportMode(), PeerFacts(host_id(), os.getpid(), instance=INSTANCE))
