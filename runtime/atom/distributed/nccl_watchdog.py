"""Wait out the NCCL watchdog before a CUDA-graph recording.

The process group's watchdog thread polls the event of every outstanding NCCL work. If an
eager collective (the logits all-gather of the step before, a warm-up step's all-reduce) is
still pending on the NCCL stream when a capture begins, that poll lands inside the capture
and invalidates it; `torch.cuda.synchronize()` does not help, because the watchdog keeps
the work in its queue until its own next poll. So every eager collective leaves its work
handle here, and `drain_nccl_works()` waits each one to completion before recording.
Without a group or on gloo there is no watchdog: the drain only counts the call.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from atom.distributed.parallel_state import tp_state

_PRUNE_EVERY = 256  # completed works are dropped this often, so the list stays short
_POLL_S = 0.0005

_lock = threading.Lock()
_pending: list[Any] = []  # torch.distributed Work handles of eager NCCL collectives
_stats = {"drains": 0, "works_drained": 0}


def track(work: Any) -> None:
    """Keep an eager collective's work handle until a drain (or until it completed)."""
    with _lock:
        _pending.append(work)
        if len(_pending) >= _PRUNE_EVERY:
            _pending[:] = [w for w in _pending if not w.is_completed()]


def pending_works() -> int:
    with _lock:
        return len(_pending)


def drain_nccl_works() -> int:
    """Wait until every tracked eager collective has completed; returns how many were waited
    on. A no-op without a group or on gloo (the call is still counted)."""
    with _lock:
        _stats["drains"] += 1
        works, _pending[:] = list(_pending), []
    if tp_state().backend != "nccl":
        return 0
    for work in works:
        work.wait()  # the current stream waits for the NCCL stream ...
        while not work.is_completed():  # ... and the host for the work itself
            time.sleep(_POLL_S)
    if works and torch.cuda.is_available():
        torch.cuda.synchronize()
    _stats["works_drained"] += len(works)
    return len(works)


def drain_stats() -> dict[str, int]:
    """{"drains": calls so far, "works_drained": work handles waited on} (tests read it)."""
    with _lock:
        return dict(_stats)
