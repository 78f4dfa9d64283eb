"""The facts that decide whether two instances can move KV GPU -> GPU: same host, which GPU.

Sent by the decode side in the PULL handshake and compared by the prefill side (negotiate.py).
Pure data here; `local_facts` reads this process' host and GPUs (torch imported lazily).
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

INSTANCE = secrets.token_hex(8)  # this process' id in handshakes
_HOST_ID_FILES = ("/proc/sys/kernel/random/boot_id", "/etc/machine-id")


@dataclass(frozen=True)
class PeerFacts:
    host_id: str  # the kernel's boot_id: equal in every container of one host (machine-id is not)
    pid: int
    gpu_uuid: str | None = None  # the GPU its KV cache is on; None: the cache is on the CPU
    visible_gpus: tuple[str, ...] = field(default_factory=tuple)  # UUIDs this process can open
    # Random per process: pids repeat across the pid namespaces of one host's pods (pid 1...).
    instance: str = ""

    def same_process(self, other: PeerFacts) -> bool:
        if self.host_id != other.host_id:
            return False
        if self.instance and other.instance:
            return self.instance == other.instance
        return self.pid == other.pid  # a peer that sent no instance id

    def to_dict(self) -> dict[str, Any]:
        return {
            "host_id": self.host_id,
            "pid": self.pid,
            "gpu_uuid": self.gpu_uuid,
            "visible_gpus": list(self.visible_gpus),
            "instance": self.instance,
        }

    @classmethod
    def from_dict(cls, data: Any) -> PeerFacts:
        """ValueError naming the field (the peer chose it)."""
        if not isinstance(data, dict):
            raise ValueError("transport.peer must be an object")
        host, pid, gpu = data.get("host_id"), data.get("pid"), data.get("gpu_uuid")
        gpus = data.get("visible_gpus", [])
        instance = data.get("instance", "")
        if not isinstance(host, str) or not host:
            raise ValueError("transport.peer.host_id must be a non-empty string")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise ValueError("transport.peer.pid must be an integer")
        if gpu is not None and not isinstance(gpu, str):
            raise ValueError("transport.peer.gpu_uuid must be a string or null")
        if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
            raise ValueError("transport.peer.visible_gpus must be a list of strings")
        if not isinstance(instance, str):
            raise ValueError("transport.peer.instance must be a string")
        return cls(host[:128], pid, gpu, tuple(g[:64] for g in gpus[:64]), instance[:64])


def host_id() -> str:
    for path in _HOST_ID_FILES:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value:
            return value
    return socket.gethostname()


def gpu_uuids() -> list[str]:
    """UUIDs of the GPUs this process sees, by ordinal ([] without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def local_facts(device: Any) -> PeerFacts:
    """This process' facts, its KV cache on `device` (a torch.device or its string)."""
    import torch

    dev = torch.device(device)
    visible = gpu_uuids() if dev.type == "cuda" else []
    gpu = None
    if dev.type == "cuda" and visible:
        gpu = visible[dev.index if dev.index is not None else torch.cuda.current_device()]
    return PeerFacts(host_id(), os.getpid(), gpu, tuple(visible), INSTANCE)
