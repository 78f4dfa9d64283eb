"""Choosing a transport: pure functions over what both sides said (no torch, no sockets).

The decode side sends an `Offer` in its PULL (handshake 2): the transports it can use, fastest
first, and its PeerFacts. The prefill side answers the first one it can use too (`Decision`),
or refuses naming why. A decode of handshake 1 sends no offer: it gets TCP.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from atom.disagg.peer import PeerFacts
from atom.disagg.transport import SPEED_ORDER, TransportMode, TransportName

HANDSHAKE_VERSION = 2  # 1: no `transport` field (TCP only); the frame version stays 1


@dataclass(frozen=True)
class Offer:
    accept: tuple[TransportName, ...]  # what the decode side can use, fastest first
    peer: PeerFacts
    handshake: int = HANDSHAKE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {
            "handshake": self.handshake,
            "accept": [str(t) for t in self.accept],
            "peer": self.peer.to_dict(),
        }

    @classmethod
    def from_body(cls, body: dict[str, Any]) -> Offer | None:
        """The PULL's offer; None from a handshake-1 decode. ValueError if malformed."""
        data = body.get("transport")
        if data is None:
            return None
        if not isinstance(data, dict):
            raise ValueError("transport must be an object")
        version, accept = data.get("handshake"), data.get("accept")
        if not isinstance(version, int) or isinstance(version, bool) or version < 2:
            raise ValueError(f"transport.handshake must be an integer >= 2, got {version!r}")
        if not isinstance(accept, list) or not accept:
            raise ValueError("transport.accept must be a non-empty list")
        # Names this side does not know (a newer peer's) are skipped, not refused.
        known = tuple(TransportName(a) for a in accept if a in set(TransportName))
        return cls(known, PeerFacts.from_dict(data.get("peer")), version)


@dataclass
class Decision:
    chosen: TransportName | None  # None: refused (see `refused`)
    refused: dict[TransportName, str] = field(default_factory=dict)  # faster ones, and why not

    @property
    def reason(self) -> str:
        return "; ".join(f"{t}: {why}" for t, why in self.refused.items()) or "nothing offered"


def local_accept(
    mode: TransportMode, why_unavailable: Mapping[TransportName, str | None]
) -> tuple[TransportName, ...]:
    """The decode side's offer list: what it can use under its mode, fastest first."""
    return tuple(
        t for t in SPEED_ORDER if mode.allows(t) and why_unavailable.get(t, "unknown") is None
    )


def negotiate(
    mode: TransportMode,
    offer: Offer | None,
    why_unreachable: Callable[[TransportName, PeerFacts], str | None],
) -> Decision:
    """The prefill side's answer. `why_unreachable(t, peer)`: None when this instance can move
    blocks to `peer` over t. Under `auto` the fastest common one wins; a forced mode accepts its
    own transport only (an old decode, offering nothing, is then refused)."""
    if offer is None:
        if mode.forced is None or mode.forced == TransportName.TCP:
            return Decision(TransportName.TCP)
        why = "the decode instance predates KV transports (TCP only)"
        return Decision(None, {mode.forced: why})
    decision = Decision(None)
    for t in SPEED_ORDER:
        if t not in offer.accept:
            continue
        if not mode.allows(t):
            decision.refused[t] = f"this prefill instance runs --kv-transport {mode}"
            continue
        unreachable = why_unreachable(t, offer.peer)
        if unreachable is None:
            decision.chosen = t
            return decision
        decision.refused[t] = unreachable
    if mode.forced is not None and mode.forced not in offer.accept:
        decision.refused[mode.forced] = "the decode instance does not offer it"
    return decision


def same_host_gpu_reason(name: TransportName, local: PeerFacts, peer: PeerFacts) -> str | None:
    """Why a same-host GPU transport cannot join the prefill `local` to the decode `peer`."""
    if local.gpu_uuid is None:
        return "the prefill instance's KV cache is not on a GPU"
    if peer.gpu_uuid is None:
        return "the decode instance's KV cache is not on a GPU"
    if peer.host_id != local.host_id:
        return "the instances run on different hosts (boot_id differs)"
    if local.same_process(peer):
        return "both sides are one process"
    if name == TransportName.CUDA_IPC and local.gpu_uuid not in peer.visible_gpus:
        return f"the decode instance cannot see GPU {local.gpu_uuid} (it sees {len(peer.visible_gpus)} GPU(s))"
    if name == TransportName.NCCL and local.gpu_uuid == peer.gpu_uuid:
        return "both KV caches are on one GPU (NCCL needs two)"
    return None


def auto_nccl_reason(name: TransportName, local: PeerFacts, peer: PeerFacts) -> str | None:
    """Under `auto`, nccl only where NCCL can go GPU to GPU: the decode process sees this GPU.
    Pods with one GPU each (the device plugin's usual grant) share no GPU and no /dev/shm, so
    NCCL would take its socket path, no faster than tcp and with a communicator to build per
    pair first. A forced `--kv-transport nccl` skips this rule (the user knows the node)."""
    if name == TransportName.NCCL and local.gpu_uuid not in peer.visible_gpus:
        return (f"under auto, only where NCCL can go GPU to GPU (the decode instance does not "
                f"see GPU {local.gpu_uuid}; NCCL's socket path is no faster than tcp)")
    return None
