"""The static buffers a decoder layer's LoRA path reads.

Each projection group (merged q/k/v, o, merged gate/up, down) has two stacked buffers,
A [max_loras + 1, shards x max_rank, in] and B [max_loras + 1, shards x max_rank, out]: slot 0
is "no adapter" and stays zero. A merged group's shards each own a band of max_rank rows of A
and the matching rows of B, nonzero only in that shard's output columns, so one delta covers
q, k and v (or gate and up) at once. Loading an adapter copies into its slot in place: the
addresses compiled code and recorded graphs read never change.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atom.lora.adapter import TARGETS, LoRAPair
from atom.lora.ops import lora_delta

GROUPS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class GroupShape:
    """A projection group's input width and its shards' (offset, size) in the output."""

    in_features: int
    shards: dict[str, tuple[int, int]]

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.shards.values())


class LoRARows(nn.Module):
    """The step's per-row slot (set by the model runner before each forward; 0 = no adapter)
    and the slot ids 1..max_loras, shared by every layer."""

    def __init__(self, max_loras: int, max_rows: int, device: torch.device) -> None:
        super().__init__()
        self.register_buffer("slots", torch.zeros(max_rows, dtype=torch.long, device=device),
                             persistent=False)
        self.register_buffer("ids", torch.arange(1, max_loras + 1, device=device),
                             persistent=False)

    def use_slots(self, slots: torch.Tensor) -> None:
        """Read the rows' slots from `slots` (the runner's staged buffer) from now on; set
        before the first forward, so compiled code and graphs see this address only."""
        self.slots = slots


class LoRALayer(nn.Module):
    """One decoder layer's stacked adapter buffers and its delta per projection group."""

    def __init__(self, shapes: dict[str, GroupShape], rows: LoRARows, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.shapes, self.rows, self.max_rank = shapes, rows, max_rank
        for group, shape in shapes.items():
            k = len(shape.shards) * max_rank
            self.register_buffer(f"{group}_a", torch.zeros(max_loras + 1, k, shape.in_features,
                                                           dtype=dtype, device=device),
                                 persistent=False)
            self.register_buffer(f"{group}_b", torch.zeros(max_loras + 1, k, shape.out_features,
                                                           dtype=dtype, device=device),
                                 persistent=False)

    def buffers_of(self, group: str) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.get_buffer(f"{group}_a"), self.get_buffer(f"{group}_b")
        return a, b

    def delta(self, group: str, x: torch.Tensor) -> torch.Tensor:
        """Each row's adapter update of group's output for input x [T, in] (zero for rows of
        slot 0)."""
        a, b = self.buffers_of(group)
        rows = self.rows
        return lora_delta(x, a[1:], b[1:], rows.get_buffer("slots"), rows.get_buffer("ids"))

    @torch.no_grad()
    def clear_slot(self, slot: int) -> None:
        for group in self.shapes:
            for t in self.buffers_of(group):
                t[slot].zero_()

    @torch.no_grad()
    def set_slot(self, slot: int, pairs: dict[str, LoRAPair]) -> None:
        """Slot `slot` holds these updates (Hugging Face module name -> pair); the modules not
        named stay zero."""
        self.clear_slot(slot)
        r = self.max_rank
        for module, pair in pairs.items():
            group, shard = TARGETS[module]
            shape = self.shapes[group]
            band = list(shape.shards).index(shard) * r
            start, size = shape.shards[shard]
            rank, width = pair.a.shape
            if width != shape.in_features or pair.b.shape[0] != size:
                raise ValueError(f"{module}: LoRA shapes A {tuple(pair.a.shape)}, B "
                                 f"{tuple(pair.b.shape)} do not fit the projection "
                                 f"({shape.in_features} -> {size})")
            a, b = self.buffers_of(group)
            a[slot, band:band + rank].copy_(pair.a)
            b[slot, band:band + rank, start:start + size].copy_(pair.b.T)
