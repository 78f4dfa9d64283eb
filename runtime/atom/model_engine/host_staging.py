"""A step's inputs on their way to the device: packed device buffers and their host mirrors.

The runner's input buffers (token ids, positions, slots, context lengths, cumulative lengths,
block tables) must keep their addresses across steps (recorded graphs read them). Here they
are views into one packed device buffer per dtype, mirrored by one persistent host buffer
each (pinned on CUDA). A step writes its values into the mirrors through numpy, then one copy
per dtype moves everything up to the last value written: two copies a step instead of one per
input, and no tensor built from a Python list or pinned allocation per input
(bench/profile_step.py: input preparation was the largest host cost of a decode step).

The copies are asynchronous, so a mirror may be written again only once the copies that read
it have run: `begin` waits for the event `flush` recorded after them (already passed in the
engine's loop, which synchronises when it samples). On the CPU the packed buffers are host
memory: the mirrors are the buffers themselves and nothing is copied.

Each step overwrites the front of each field; what lies past it keeps the values of earlier
steps (readers never go past a step's own rows, sequences and blocks).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# name -> (dtype, shape, initial value); fields of one dtype are packed in this order.
Field = tuple[torch.dtype, tuple[int, ...], int]


class HostStaging:
    """The fields' device buffers (`buffers`) and the host side that fills them."""

    def __init__(self, fields: dict[str, Field], device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        sizes: dict[torch.dtype, int] = {}
        # name -> (dtype, first element, elements per leading index)
        self._where: dict[str, tuple[torch.dtype, int, int]] = {}
        for name, (dtype, shape, _) in fields.items():
            start = sizes.get(dtype, 0)
            self._where[name] = (dtype, start, math.prod(shape[1:]))
            sizes[dtype] = start + math.prod(shape)
        self._device = {dt: torch.empty(n, dtype=dt, device=device) for dt, n in sizes.items()}
        if self._cuda:
            self._host = {dt: torch.empty(n, dtype=dt, pin_memory=True) for dt, n in sizes.items()}
            self._copied = torch.cuda.Event()
        else:
            self._host = self._device
        self.buffers: dict[str, torch.Tensor] = {}  # the device views, at fixed addresses
        self._arrays: dict[str, np.ndarray] = {}  # the host views
        for name, (dtype, start, _) in self._where.items():
            shape = fields[name][1]
            n = math.prod(shape)
            self.buffers[name] = self._device[dtype][start:start + n].view(shape)
            self._arrays[name] = self._host[dtype][start:start + n].view(shape).numpy()
            self._arrays[name][...] = fields[name][2]
        if self._cuda:
            for dt, dev in self._device.items():
                dev.copy_(self._host[dt])
        self._ends = dict.fromkeys(sizes, 0)
        self._pending = False

    def begin(self) -> None:
        """Before writing a step's inputs: the last step's copies have read the mirrors."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def _wrote(self, name: str, n: int) -> None:
        dtype, start, row = self._where[name]
        end = start + n * row
        if end > self._ends[dtype]:
            self._ends[dtype] = end

    def put(self, name: str, values: Sequence[int]) -> torch.Tensor:
        """values at the front of field `name`; the device slice they will land in."""
        n = len(values)
        if n:
            self._arrays[name][:n] = values
            self._wrote(name, n)
        return self.buffers[name][:n]

    def put_rows(self, name: str, rows: Sequence[Sequence[int]]) -> None:
        """Row i of the 2-D field `name` starts with rows[i]; the rest of each row keeps what
        it held. Whole rows are copied: no padding to write, however ragged the rows."""
        arr = self._arrays[name]
        for i, row in enumerate(rows):
            if row:
                arr[i, :len(row)] = row
        if rows:
            self._wrote(name, len(rows))

    def flush(self) -> None:
        """Issue the copies of what was written since the last flush (on the current stream)."""
        if self._cuda:
            for dt, end in self._ends.items():
                if end:
                    self._device[dt][:end].copy_(self._host[dt][:end], non_blocking=True)
            self._copied.record()
            self._pending = True
        self._ends = dict.fromkeys(self._ends, 0)
