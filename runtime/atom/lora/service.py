"""The engine's LoRA surface: requests naming an adapter, loads and unloads, who uses what.

Resolution happens when a request is added: its sequence gets the adapter's slot (read by the
model runner per row) and the adapter's prefix-cache key (so blocks computed under one
adapter are never served to another, nor to the base model).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from atom.lora.manager import LoRAManager


class AdapterSeq(Protocol):
    """What the service sets and reads on a sequence (atom.engine.sequence.Sequence)."""

    lora_slot: int
    lora_name: str | None
    cache_salt: bytes


class LiveQueues(Protocol):
    """Where the live requests are (atom.engine.scheduler.Scheduler)."""

    @property
    def running(self) -> Iterable[AdapterSeq]: ...

    @property
    def waiting(self) -> Iterable[AdapterSeq]: ...


@dataclass(frozen=True)
class LoRAUsage:
    """vllm:lora_requests_info's facts: the slot budget and the adapters of the running and
    waiting requests (sorted names)."""

    max_loras: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]


class LoRAService:
    def __init__(self, manager: LoRAManager, queues: LiveQueues) -> None:
        self.manager, self.queues = manager, queues

    def assign(self, seq: AdapterSeq, name: str | None) -> None:
        """seq runs under adapter `name` (None: the base model); a ValueError for an
        unknown name."""
        if name is None:
            return
        adapter = self.manager.get(name)
        seq.lora_slot, seq.lora_name, seq.cache_salt = adapter.slot, name, adapter.cache_key

    def load(self, name: str, path: str) -> None:
        self.manager.load(name, path)

    def unload(self, name: str) -> None:
        """Free the adapter's slot; a KeyError when not loaded, a ValueError while a live
        request still uses it."""
        adapter = self.manager.adapters.get(name)
        if adapter is None:
            raise KeyError(name)
        live = [*self.queues.running, *self.queues.waiting]
        users = sum(1 for s in live if s.lora_slot == adapter.slot)
        if users:
            raise ValueError(f"LoRA adapter {name!r} is in use by {users} request(s)")
        self.manager.unload(name)

    def adapters(self) -> dict[str, str]:
        """Loaded adapter name -> the directory it was read from."""
        return {a.name: a.path for a in self.manager.adapters.values()}

    def usage(self) -> LoRAUsage:
        def names(seqs: Iterable[AdapterSeq]) -> tuple[str, ...]:
            return tuple(sorted({s.lora_name for s in seqs if s.lora_name is not None}))

        return LoRAUsage(self.manager.config.max_loras, names(self.queues.running),
                         names(self.queues.waiting))
