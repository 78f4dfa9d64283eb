"""CPU emulation of CUDA-graph capture, for the CPU tests of recording and dispatch.

`CpuOpRecorder` is a `SegmentRecorder` (atom.cudagraph.region_graph) that records the aten
ops dispatched while a segment is open and re-runs them at replay; tests pass it as the
recorder (or `recorder_factory`) where production captures with CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import torch

from atom.cudagraph.region_graph import Segment


class CpuOpRecorder:
    """Emulates CUDA-graph capture on any device by recording dispatched aten ops.

    A segment is the list of ops run while it was open; replay re-runs them on the recorded
    tensors and copies each fresh result into the tensor the recording produced, so later
    ops (and eager regions) see it at the same address, as in a CUDA graph. Results that
    aliased an input at record time (views, in-place ops, a no-op .to()/.contiguous()) need no
    copy: re-running the op mutates or views the same storage. Used by CPU tests of the
    recording and dispatch logic at eager levels; compiled (Inductor) code does not dispatch
    aten ops and cannot be emulated this way.
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                before = recorder._breaks
                out = func(*args, **kwargs)
                if recorder._ops is not None and recorder._breaks == before:
                    recorder._ops.append(
                        (func, args, kwargs, out, _fresh_outputs(args, kwargs, out))
                    )
                return out

        self._mode = _Mode()
        self._ops: list[tuple[Any, ...]] | None = None
        self._breaks = 0

    def enter(self) -> None:
        self._mode.__enter__()

    def begin(self) -> None:
        self._ops = []

    def end(self) -> Segment:
        ops, self._ops = self._ops or [], None
        self._breaks += 1
        return _CpuSegment(ops)

    def exit(self) -> None:
        self._ops = None
        self._mode.__exit__(None, None, None)

    def is_capturing(self) -> bool:
        return self._ops is not None


def _storages(tree: Any) -> set[int]:
    from torch.utils._pytree import tree_leaves

    return {
        t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)
    }


def _fresh_outputs(args: Any, kwargs: Any, out: Any) -> list[bool]:
    """Per output: True when it owns new storage (replay must copy into it)."""
    inputs = _storages((args, kwargs))
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [
        isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in inputs for o in outs
    ]


_ALLOCATORS = (
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.empty_strided.default,
)


class _CpuSegment:
    def __init__(self, ops: list[tuple[Any, ...]]) -> None:
        self.ops = ops

    def replay(self) -> None:
        for func, args, kwargs, out, fresh in self.ops:
            if func in _ALLOCATORS:  # an allocation is no work in a graph either
                continue
            res = func(*args, **kwargs)
            outs = out if isinstance(out, (tuple, list)) else (out,)
            ress = res if isinstance(res, (tuple, list)) else (res,)
            for o, r, f in zip(outs, ress, fresh, strict=False):
                if f and isinstance(r, torch.Tensor):
                    o.copy_(r)
