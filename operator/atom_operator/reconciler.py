"""The operator's one entry point for reconciling an AtomDeployment, and the owner of all it
remembers per object: the Kopf handlers and the background triggers both call `run`.

Per object (by uid) it keeps an `ObjectMemory` (applied cache, token Secrets seen, last status),
a lock that serializes its reconciles, its consecutive failures and when it was last
reconciled. `forget(uid)` drops all of it: on delete, and for any uid a resync no longer lists.

With leader election each run writes through the fence of the term it began in (leader.py):
a run that finds its replica no longer leading is abandoned at its next write, with a log line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from atom_operator.kube import ApiError, Kube, NotLeading, StaleStatus
from atom_operator.leader import Leadership
from atom_operator.logs import Logger
from atom_operator.metrics import ReconcileStats
from atom_operator.reconcile import ObjectMemory, reconcile
from atom_operator.settings import Settings
from atom_operator.spec import KIND
from atom_operator.status import status_patch

RETRY_BASE_S = 1.0
RETRY_MAX_S = 16.0


@dataclass
class Outcome:
    """What one reconcile leaves to its caller: the status merge patch it wrote (empty:
    nothing changed) and, after a failed apply, when to try again."""

    patch: dict[str, Any] = field(default_factory=dict)
    retry_in: float | None = None


def retry_delay(failures: int) -> float | None:
    """Exponential backoff after consecutive failed applies (1, 2, 4, ... 16 s); none after
    a clean reconcile. Bounded so a quota lifted is noticed within seconds, not at the resync."""
    if failures <= 0:
        return None
    return min(RETRY_BASE_S * 2 ** (failures - 1), RETRY_MAX_S)


@dataclass
class _Tracked:
    """One object's entry. `users` counts the runs holding or waiting for `lock`: an entry in
    use is only marked `forgotten`, and dropped when its last user leaves, so two runs of one
    object always share one lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    memory: ObjectMemory = field(default_factory=ObjectMemory)
    failures: int = 0  # consecutive reconciles with a failed apply
    touched: float = 0.0  # monotonic time the latest run began
    last_done: float | None = None  # monotonic time the latest run finished
    users: int = 0
    forgotten: bool = False


def _sooner(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class Reconciler:
    def __init__(
        self, kube: Kube, settings: Settings, leadership: Leadership | None = None
    ) -> None:
        self.kube = kube
        self.settings = settings
        self.leadership = leadership  # None: one replica, writes unfenced
        self.stats = ReconcileStats()
        self._guard = threading.Lock()  # guards _objects and every entry's users/forgotten
        self._objects: dict[str, _Tracked] = {}

    @contextmanager
    def _hold(self, uid: str) -> Iterator[_Tracked]:
        with self._guard:
            tracked = self._objects.get(uid)
            if tracked is None:
                tracked = self._objects[uid] = _Tracked()
            # Still in use after a forget: keep it (one lock per object); the next resync's
            # `retain` drops it if the object is really gone.
            tracked.forgotten = False
            tracked.users += 1
            tracked.touched = time.monotonic()
        try:
            with tracked.lock:
                yield tracked
        finally:
            with self._guard:
                tracked.users -= 1
                if tracked.forgotten and not tracked.users:
                    del self._objects[uid]

    def run(self, obj: Mapping[str, Any], logger: Logger) -> Outcome:
        """Reconcile one AtomDeployment (its metadata, spec and status as last seen) and write
        its status. Kopf handlers and the background triggers of one object never interleave."""
        meta = obj["metadata"]
        previous = dict(obj.get("status") or {})
        kube = self.kube if self.leadership is None else self.kube.fenced(self.leadership.fence())
        try:
            return self._run(kube, obj, previous, logger)
        except NotLeading as exc:
            logger.warning(
                "reconcile of %s/%s abandoned, nothing more written: %s",
                meta["namespace"],
                meta["name"],
                exc,
            )
            return Outcome()

    def _run(
        self, kube: Kube, obj: Mapping[str, Any], previous: dict[str, Any], logger: Logger
    ) -> Outcome:
        meta = obj["metadata"]
        uid = meta["uid"]
        generation = meta.get("generation", 1)
        with self._hold(uid) as tracked:
            result = reconcile(
                kube,
                tracked.memory,
                name=meta["name"],
                namespace=meta["namespace"],
                uid=uid,
                generation=generation,
                spec_body=dict(obj.get("spec") or {}),
                previous_status=previous,
                default_image=self.settings.default_image,
                logger=logger,
                allow_host_volumes=self.settings.allow_host_volumes,
            )
            patch = status_patch(previous, result.status)
            if patch:  # observedGeneration always sent: the write's fence (kube.patch_status)
                body = {**patch, "observedGeneration": generation}
                self._write_status(kube, meta["namespace"], meta["name"], body, logger)
            tracked.last_done = time.monotonic()
            tracked.failures = tracked.failures + 1 if result.errors else 0
            failures = tracked.failures
        self.stats.record(result.seconds, failed=bool(result.errors))
        return Outcome(patch, _sooner(retry_delay(failures), result.recheck_in))

    def _write_status(
        self, kube: Kube, namespace: str, name: str, patch: dict[str, Any], logger: Logger
    ) -> None:
        # The one status writer, for Kopf handlers and background triggers alike: a merge patch
        # of the status subresource, sent while the object's lock is held. Kopf's own
        # `patch.status` is sent after the handler returns, outside that lock, so a background
        # reconcile that computed a newer status could land first and then be overwritten by
        # the handler's older one. Within this process the lock fixes the order of the writes;
        # across processes (a frozen leader that wakes) two fences do: the run's leader term
        # (NotLeading) and observedGeneration, never written backwards (kube.patch_status reads
        # the stored one and sends its resourceVersion as a precondition: StaleStatus).
        try:
            kube.patch_status(KIND, namespace, name, patch)
        except StaleStatus as exc:
            logger.info("status of %s/%s not written: %s", namespace, name, exc.message)
        except ApiError as exc:
            if exc.status == 404:  # deleted meanwhile: nothing left to describe
                return
            # Not retried here: the next trigger computes the same patch against the stored
            # status and sends it again.
            logger.warning("writing the status of %s/%s failed: %s", namespace, name, exc.message)

    def forget(self, uid: str) -> None:
        """Drop what this process remembers of the object (it was deleted)."""
        with self._guard:
            tracked = self._objects.get(uid)
            if tracked is None:
                return
            if tracked.users:
                tracked.forgotten = True  # the last run to leave drops it
            else:
                del self._objects[uid]

    def retain(self, uids: set[str], listed_since: float) -> None:
        """Forget every object a resync listing no longer names. `listed_since`: the monotonic
        time the listing started; an object whose run began later may be newer than the list."""
        with self._guard:
            gone = [
                uid
                for uid, tracked in self._objects.items()
                if uid not in uids and tracked.touched < listed_since
            ]
        for uid in gone:
            self.forget(uid)

    def tracked(self) -> set[str]:
        """The uids this process remembers."""
        with self._guard:
            return {uid for uid, tracked in self._objects.items() if not tracked.forgotten}

    def seconds_since_reconcile(self, uid: str) -> float:
        """How long ago this object was last reconciled (inf: never, by this process)."""
        with self._guard:
            tracked = self._objects.get(uid)
            done = None if tracked is None else tracked.last_done
        return float("inf") if done is None else time.monotonic() - done
