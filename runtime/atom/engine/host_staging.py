"""A step's inputs on their way to the device: packed device buffers and their host mirrors.

The runner's input buffers (token ids, positions, slots, context lengths, cumulative lengths,
block tables) must keep their addresses across steps (recorded graphs read them). Here they
are views into one packed device buffer per dtype, mirrored by one persistent host buffer
each (pinned on CUDA). A step writes its values into the mirrors through numpy; then one
kernel reads what each field had written straight from the pinned mirrors
(atom.kernels.triton_copy.stage_to_device): no copy-engine copy, whose switches to and from
the SMs idled the GPU, and only the written front of each field (of a 2-D field, the front
of each written row), not everything up to the last field written. Layouts the kernel does not take (more than two dtypes or eight fields)
use one copy per dtype.

A token-id field may hold placeholders: -(j + 1) stands for the j-th token the previous step
sampled, still on the device (asynchronous scheduling); `flush(gather=...)` fills them in on
the device, in the same kernel.

The reads are asynchronous, so a mirror may be written again only once the kernel that reads
it has run: `begin` waits for the event `flush` recorded after it (already passed in the
engine's loop, which reads a step's tokens before preparing the step after next). On the CPU
the packed buffers are host memory: the mirrors are the buffers themselves and nothing is
copied.

Each step overwrites the front of each field; what lies past it keeps the values of earlier
steps (readers never go past a step's own rows, sequences and blocks). Block-table rows can be
put by request id: a request's row is converted from its list only when its blocks changed,
and the step's rows are gathered from those in one numpy copy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

# name -> (dtype, shape, initial value); fields of one dtype are packed in this order.
Field = tuple[torch.dtype, tuple[int, ...], int]
# False: the copy engine copies each dtype's buffer up to its last written value
# (bench/profile_step.py --kernels compares the two).
DEVICE_READS_MIRRORS = True


def fill_placeholders(ids: torch.Tensor, tokens: torch.Tensor) -> None:
    """ids' placeholders -(j + 1) replaced by tokens[j], in place, on ids' device without a
    host synchronisation (the torch form of the staging kernel's gather)."""
    if tokens.numel() == 0 or ids.numel() == 0:
        return
    src = (-ids - 1).clamp_(0, tokens.numel() - 1)
    ids.copy_(torch.where(ids < 0, tokens.to(ids.dtype)[src], ids))


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
        # field -> (leading rows, values a row) written since the last flush
        self._written: dict[str, tuple[int, int]] = {}
        self._pending = False
        self._stores: dict[str, _RowStore] = {}  # 2-D field -> its keyed rows (put_rows)

    def begin(self) -> None:
        """Before writing a step's inputs: the last step's copies have read the mirrors."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def _wrote(self, name: str, rows: int, cols: int | None = None) -> None:
        """rows leading rows of `name` written, cols values each (None: whole rows)."""
        row = self._where[name][2]
        cols = row if cols is None else cols
        was_rows, was_cols = self._written.get(name, (0, 0))
        self._written[name] = (max(rows, was_rows), max(cols, was_cols))

    def host(self, name: str) -> np.ndarray:
        """The host mirror of field `name` (what a step's puts write into)."""
        return self._arrays[name]

    def put(self, name: str, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """values at the front of field `name`; the device slice they will land in."""
        n = len(values)
        if n:
            self._arrays[name][:n] = values
            self._wrote(name, n)
        return self.buffers[name][:n]

    def put_rows(self, name: str, rows: Sequence[Sequence[int]],
                 keys: Sequence[str] | None = None) -> None:
        """Row i of the 2-D field `name` starts with rows[i]; the rest of each row keeps what
        it held (no padding to write, however ragged the rows). keys (unique, one a row: the
        request ids of a step's block tables): each key's row is kept in a store and converted
        only when it changed since the key's last put, then the rows are gathered at once
        (most block tables do not change from one step to the next, though a request that
        ends moves those after it up a row)."""
        arr = self._arrays[name]
        slots = None
        store: _RowStore | None = None
        if keys is not None:
            store = self._stores.get(name)
            if store is None:
                store = self._stores[name] = _RowStore(2 * arr.shape[0], arr.shape[1], arr.dtype)
            slots, width = store.slots(keys, rows)
        if slots is not None and store is not None:  # a store gave the slots
            if width:
                arr[:len(rows), :width] = store.values[slots, :width]
        else:
            width = 0
            for i, row in enumerate(rows):
                if row:
                    arr[i, :len(row)] = row
                    width = max(width, len(row))
        if rows:
            # the staging kernel reads each row's front only (a long max_model_len makes
            # block-table rows of thousands of entries, of which a step uses a few)
            self._wrote(name, len(rows), width)

    def flush(self, gather: tuple[str, torch.Tensor] | None = None) -> None:
        """Move what was written since the last flush to the device (on the current stream).
        gather (field, tokens on the device): the written front of that field has its
        placeholders -(j + 1) replaced by tokens[j]."""
        written, self._written = self._written, {}
        if not self._cuda:
            self._fill(gather, written)
            return
        dtypes = list(self._device)
        # (buffer, first element, rows, values a row, row stride, field) of each written
        # field, buffer by buffer
        segments = sorted((dtypes.index(self._where[name][0]), self._where[name][1], rows, cols,
                           self._where[name][2], name)
                          for name, (rows, cols) in written.items())
        gather_at = None
        if gather is not None and gather[0] in written:
            gather_at = ([seg[5] for seg in segments].index(gather[0]), gather[1])
        from atom.kernels.triton_copy import MAX_SEGMENTS, stage_to_device

        if (DEVICE_READS_MIRRORS and len(dtypes) <= 2 and len(segments) <= MAX_SEGMENTS
                and (gather_at is None or segments[gather_at[0]][0] == 0)):
            stage_to_device([(self._host[dt], self._device[dt]) for dt in dtypes],
                            [seg[:5] for seg in segments], gather_at)
        else:  # whole rows, up to each buffer's last written row
            for b, dt in enumerate(dtypes):
                end = max((start + rows * stride for sb, start, rows, _, stride, _ in segments
                           if sb == b), default=0)
                if end:
                    self._device[dt][:end].copy_(self._host[dt][:end], non_blocking=True)
            self._fill(gather, written)
        self._copied.record()
        self._pending = True

    def _fill(self, gather: tuple[str, torch.Tensor] | None,
              written: dict[str, tuple[int, int]]) -> None:
        if gather is not None:
            name, tokens = gather
            rows = written.get(name, (0, 0))[0]
            fill_placeholders(self.buffers[name][:rows].view(-1), tokens)


class _RowStore:
    """Rows by key in one array (twice a field's rows), each written when its values change."""

    def __init__(self, capacity: int, width: int, dtype: np.dtype) -> None:
        self.values = np.zeros((capacity, width), dtype=dtype)
        self._slot: dict[str, int] = {}
        self._held: list[list[int] | None] = [None] * capacity  # what values[slot] starts with
        self._free = list(range(capacity - 1, -1, -1))

    def slots(self, keys: Sequence[str], rows: Sequence[Sequence[int]]
              ) -> tuple[list[int] | None, int]:
        """Each row's slot (None when keys repeat), its values written where they changed,
        and the longest row's length."""
        out = []
        width = 0
        slot_of, held, values = self._slot, self._held, self.values
        for key, row in zip(keys, rows, strict=True):
            slot = slot_of.get(key)
            if slot is None:
                slot = slot_of[key] = self._take(keys)
            n = len(row)
            if n > width:
                width = n
            if held[slot] != row:
                if n:
                    values[slot, :n] = row
                held[slot] = list(row)
            out.append(slot)
        return (out if len(set(out)) == len(out) else None), width

    def _take(self, live: Sequence[str]) -> int:
        if not self._free:  # keys of earlier steps only make room (a batch fits twice over)
            keep = set(live)
            for key in [k for k in self._slot if k not in keep]:
                slot = self._slot.pop(key)
                self._held[slot] = None
                self._free.append(slot)
        return self._free.pop()
