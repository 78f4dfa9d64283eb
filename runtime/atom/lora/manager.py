"""LoRAManager: which adapter sits in which slot, and each step's per-row slots.

The runner owns one (rank 0, the only rank LoRA runs on). Adapters are loaded into a free
slot's buffers in place and unloaded by zeroing it; requests name an adapter, the engine asks
here for its slot and its prefix-cache key (which changes on every load, so a reloaded
adapter never reuses the blocks its predecessor computed).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from atom.lora.adapter import LoRAPair, load_adapter
from atom.lora.config import LoRAConfig
from atom.lora.weights import GroupShape, LoRALayer, LoRARows


@dataclass(frozen=True)
class LoadedAdapter:
    name: str
    path: str
    slot: int
    rank: int
    cache_key: bytes  # prefix-cache extra key of its requests' blocks


class LoRAManager:
    def __init__(self, config: LoRAConfig, layer_shapes: list[dict[str, GroupShape]],
                 max_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.rows = LoRARows(config.max_loras, max_rows, device)
        self.layers = [LoRALayer(shapes, self.rows, config.max_loras, config.max_lora_rank,
                                 dtype, device) for shapes in layer_shapes]
        self.adapters: dict[str, LoadedAdapter] = {}
        self._loads = itertools.count(1)

    def load_static(self) -> None:
        """The adapters of --lora-modules."""
        for name, path in self.config.modules.items():
            self.load(name, path)

    def load(self, name: str, path: str) -> LoadedAdapter:
        """Read the adapter and copy it into a free slot; a ValueError when the name is taken,
        no slot is free or the adapter does not fit the model."""
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        used = {a.slot for a in self.adapters.values()}
        free = [s for s in range(1, self.config.max_loras + 1) if s not in used]
        if not free:
            raise ValueError(f"no free LoRA slot: {len(used)} adapters loaded, --max-loras="
                             f"{self.config.max_loras}")
        adapter = load_adapter(name, path, self.config.max_lora_rank)
        per_layer: dict[int, dict[str, LoRAPair]] = {}
        for (layer, module), pair in adapter.pairs.items():
            if not 0 <= layer < len(self.layers):
                raise ValueError(f"LoRA adapter {name!r} has weights for layer {layer}; the "
                                 f"model has {len(self.layers)}")
            per_layer.setdefault(layer, {})[module] = pair
        slot = free[0]
        try:
            for i, lora in enumerate(self.layers):
                lora.set_slot(slot, per_layer.get(i, {}))
        except ValueError as exc:
            self._clear(slot)
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
        key = f"lora:{name}:{next(self._loads)}".encode()
        loaded = LoadedAdapter(name, adapter.path, slot, adapter.rank, key)
        self.adapters[name] = loaded
        return loaded

    def unload(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise KeyError(name)
        self._clear(adapter.slot)

    def _clear(self, slot: int) -> None:
        for lora in self.layers:
            lora.clear_slot(slot)

    def get(self, name: str) -> LoadedAdapter:
        """The loaded adapter `name`; a ValueError naming the loaded ones otherwise."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: "
                             f"{', '.join(sorted(self.adapters)) or 'none'})")
        return adapter

    @staticmethod
    def row_slots(num_tokens: Sequence[int], seq_slots: Sequence[int], rows: int) -> np.ndarray:
        """Each row's slot: a sequence's slot repeated over its rows, padding rows 0."""
        out = np.zeros(rows, dtype=np.int64)
        if seq_slots:
            real = np.repeat(np.asarray(seq_slots, dtype=np.int64),
                             np.asarray(num_tokens, dtype=np.int64))
            out[:len(real)] = real
        return out
