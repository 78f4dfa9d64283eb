"""Run one reconcile of one object, serialized per object, and time it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from atom_operator.kube import Kube
from atom_operator.reconcile import reconcile
from atom_operator.status import status_patch

LATENCIES: deque[float] = deque(maxlen=10000)  # seconds per reconcile (probe and benchmark)
_locks: dict[str, threading.Lock] = {}
_last_done: dict[str, float] = {}  # uid -> monotonic time of the last finished reconcile
_locks_guard = threading.Lock()
_failures: dict[str, int] = {}  # uid -> consecutive reconciles with a failed apply
TOTALS = {"reconciles": 0, "failed_reconciles": 0}  # since start (the /metrics counters)
RETRY_BASE_S = 1.0
RETRY_MAX_S = 16.0


@dataclass
class Outcome:
    """What one reconcile leaves to its caller: the status merge patch to write (empty:
    nothing changed) and, after a failed apply, when to try again."""

    patch: dict[str, Any] = field(default_factory=dict)
    retry_in: float | None = None


def retry_delay(failures: int) -> float | None:
    """Exponential backoff after consecutive failed applies (1, 2, 4, ... 16 s); none after
    a clean reconcile. Bounded so a quota lifted is noticed within seconds, not at the resync."""
    if failures <= 0:
        return None
    return min(RETRY_BASE_S * 2 ** (failures - 1), RETRY_MAX_S)


def _lock(uid: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(uid, threading.Lock())


def run_one(
    kube: Kube,
    *,
    meta: Mapping[str, Any],
    spec: Mapping[str, Any],
    status: Mapping[str, Any],
    default_image: str,
    logger: logging.Logger,
    allow_host_volumes: bool = False,
) -> Outcome:
    """Reconcile one AtomDeployment. Kopf handlers and the background triggers of one object
    never interleave."""
    uid = meta["uid"]
    with _lock(uid):
        result = reconcile(
            kube,
            name=meta["name"],
            namespace=meta["namespace"],
            uid=uid,
            generation=meta.get("generation", 1),
            spec_body=dict(spec),
            previous_status=dict(status),
            default_image=default_image,
            logger=logger,
            allow_host_volumes=allow_host_volumes,
        )
        _last_done[uid] = time.monotonic()
        failures = _failures[uid] = _failures.get(uid, 0) + 1 if result.errors else 0
    with _locks_guard:
        TOTALS["reconciles"] += 1
        TOTALS["failed_reconciles"] += bool(result.errors)
    LATENCIES.append(result.seconds)
    return Outcome(status_patch(dict(status), result.status), retry_delay(failures))


def seconds_since_reconcile(uid: str) -> float:
    """How long ago this object was last reconciled (inf: never, by this process)."""
    done = _last_done.get(uid)
    return float("inf") if done is None else time.monotonic() - done


def latency_summary() -> dict[str, float]:
    values = sorted(LATENCIES)
    if not values:
        return {"count": 0}

    def pct(q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 4)

    return {"count": len(values), "p50": pct(0.50), "p99": pct(0.99), "max": round(values[-1], 4)}
