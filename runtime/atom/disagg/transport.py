"""The KV transport seam: how a held prompt's blocks travel once the handshake agreed on a path.

The TCP control connection (wire.py) always carries the handshake, the secret check, ACK and
DONE; a transport only moves the block bytes. `tcp` moves them on that same connection; a fast
transport moves them GPU -> GPU on one host (cuda_ipc.py, nccl.py). Names are ordered by speed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

from atom.disagg.layout import KVLayout
from atom.disagg.peer import PeerFacts


class TransportName(enum.StrEnum):
    CUDA_IPC = "cuda-ipc"
    NCCL = "nccl"
    TCP = "tcp"


# Fastest first: `auto` takes the first one both sides can use.
SPEED_ORDER: tuple[TransportName, ...] = (
    TransportName.CUDA_IPC,
    TransportName.NCCL,
    TransportName.TCP,
)
FAST: tuple[TransportName, ...] = SPEED_ORDER[:-1]


@dataclass(frozen=True)
class TransportMode:
    """--kv-transport: None is `auto` (the fastest common one, falling back to TCP); a name
    forces that transport on this instance (no fallback: what cannot use it fails, naming why)."""

    forced: TransportName | None = None

    @classmethod
    def parse(cls, value: str) -> TransportMode:
        if value == "auto":
            return cls(None)
        try:
            return cls(TransportName(value))
        except ValueError:
            choices = ", ".join(["auto", *SPEED_ORDER])
            raise ValueError(f"--kv-transport {value!r} is not one of {choices}") from None

    @property
    def auto(self) -> bool:
        return self.forced is None

    def allows(self, name: TransportName) -> bool:
        return self.forced is None or self.forced == name

    def __str__(self) -> str:
        return "auto" if self.forced is None else str(self.forced)


class TransportFailure(Exception):
    """A fast transport could not move the blocks (handle not opened, group not formed, copy
    failed). The decode falls back to TCP under `auto`; under a forced transport it is a broken
    attempt (retried once)."""

    def __init__(self, transport: TransportName, cause: str) -> None:
        super().__init__(f"{transport}: {cause}")
        self.transport, self.cause = transport, cause


@dataclass
class HandleCounters:
    """Handles (IPC mappings, NCCL groups) a transport opened and closed: equal when nothing
    leaked. Tests and /metrics read them."""

    opened: int = 0
    closed: int = 0

    @property
    def open(self) -> int:
        return self.opened - self.closed


@dataclass(frozen=True)
class ReceiveContext:
    """What the decode side knows when it imports an offer."""

    layout: KVLayout
    num_blocks: int
    kv_host: str  # the prefill's KV host, as dialled (NCCL's store is reached there too)
    address: str = ""  # host:port of that KV server: one prefill process while it lives


class KVTransport(Protocol):
    """One way to move held blocks. The prefill side offers them in the transport's form (the
    JSON `offer` of the OK header, then `send` if bytes must be pushed); the decode side imports
    them into a tensor on its own device, block-major like the TCP staging tensor."""

    name: TransportName
    counters: HandleCounters

    def why_unavailable(self, local: PeerFacts) -> str | None:
        """None when this instance can use the transport at all (start-up check)."""
        ...

    def why_unreachable(self, local: PeerFacts, peer: PeerFacts) -> str | None:
        """Prefill: None when the transport reaches this decode peer (same host, GPU visible)."""
        ...

    async def export(self, kv_cache: Any, block_ids: list[int], peer: PeerFacts) -> dict[str, Any]:
        """Prefill: the offer for these blocks (JSON). TransportFailure when it cannot."""
        ...

    async def send(self, kv_cache: Any, block_ids: list[int], offer: dict[str, Any]) -> None:
        """Prefill, after OK is written: push the blocks if the transport pushes (NCCL)."""
        ...

    async def receive(self, offer: dict[str, Any], ctx: ReceiveContext) -> Any:
        """Decode: the blocks `[n, 2, layers, block, heads, dim]`; TransportFailure on failure."""
        ...

    def close(self) -> None:
        """Close every handle this transport holds (counters balance afterwards)."""
        ...


@dataclass
class TransferReport:
    """Which path one pull took: the decode's log line and metrics name it."""

    transport: TransportName = TransportName.TCP
    fallback_from: TransportName | None = None  # the fast path refused or failed
    fallback_reason: str = ""

    def describe(self) -> str:
        if self.fallback_from is None:
            return str(self.transport)
        return f"{self.transport} (fallback from {self.fallback_from}: {self.fallback_reason})"
