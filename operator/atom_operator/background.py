"""Reconcile triggers outside Kopf's per-object handlers.

- `Requeue`: a child (Deployment, Pod, Job, Service, ConfigMap, PVC) changed, so its owner is
  reconciled soon (coalesced: a burst of pod events costs one reconcile). Status follows
  readiness within a second, and a child deleted by hand comes back at once.
- the periodic resync pass: every AtomDeployment, every interval, as a safety net.
Neither is a Kopf timer or daemon: those put a finalizer on every object, and a finalizer makes
deletion hang whenever the operator is down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from atom_operator.leader import Leadership
from atom_operator.logs import Logger
from atom_operator.reconciler import Reconciler
from atom_operator.spec import GROUP, KIND, PLURAL, VERSION

COALESCE_S = 0.5


class Requeue:
    """A set of (namespace, name) keys to reconcile, drained by one worker thread; keys added
    `later` join it when their time comes (retries after a failed apply)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._pending: set[tuple[str, str]] = set()
        self._later: dict[tuple[str, str], float] = {}  # key -> due (monotonic)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._clock = clock

    def add(self, namespace: str, name: str) -> None:
        with self._lock:
            self._pending.add((namespace, name))
            self._wake.set()

    def later(self, namespace: str, name: str, delay: float) -> None:
        due = self._clock() + delay
        with self._lock:
            key = (namespace, name)
            self._later[key] = min(due, self._later.get(key, due))

    def _promote(self) -> None:
        now = self._clock()
        for key, due in list(self._later.items()):
            if due <= now:
                del self._later[key]
                self._pending.add(key)
                self._wake.set()

    def drain(self) -> set[tuple[str, str]]:
        with self._lock:
            self._promote()
            items, self._pending = self._pending, set()
            self._wake.clear()
            return items

    def wait(self, timeout: float) -> bool:
        with self._lock:
            self._promote()
            if self._later:
                timeout = max(0.0, min(timeout, min(self._later.values()) - self._clock()))
        return self._wake.wait(timeout) or self._due()

    def _due(self) -> bool:
        with self._lock:
            self._promote()
            return bool(self._pending)


class Background:
    def __init__(
        self,
        reconciler: Reconciler,
        *,
        logger: Logger,
        leader: Leadership | None = None,
    ) -> None:
        self.reconciler = reconciler
        self.kube = reconciler.kube
        self.namespaces = reconciler.settings.namespaces
        self.interval = reconciler.settings.reconcile_interval
        self.leader = leader  # None: always act
        self.logger = logger
        self.requeue = Requeue()
        self.stop = threading.Event()
        # Separate pools: a long resync pass never delays reconciles triggered by events.
        self.event_pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="requeue")
        self.resync_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="resync")

    def start(self) -> None:
        for target, name in ((self._requeue_loop, "requeue"), (self._resync_loop, "resync")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def shutdown(self) -> None:
        self.stop.set()
        self.requeue.add("", "")  # wake the worker
        for pool in (self.event_pool, self.resync_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    @property
    def leading(self) -> bool:
        return self.leader is None or self.leader.leading

    def reconcile_body(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        if meta.get("deletionTimestamp") or not self.leading:
            return
        try:
            outcome = self.reconciler.run(obj, self.logger)
            self.retry(meta["namespace"], meta["name"], outcome.retry_in)
        except Exception:  # one broken object must not stop the others
            self.logger.exception(
                "reconcile of %s/%s failed", meta.get("namespace"), meta.get("name")
            )

    def retry(self, namespace: str, name: str, delay: float | None) -> None:
        """Reconcile again after `delay` seconds (a failed apply's backoff, or a grace period
        that ends with no event to say so)."""
        if delay is not None:
            self.logger.info("reconciling %s/%s again in %.0fs", namespace, name, delay)
            self.requeue.later(namespace, name, delay)

    def _map(self, pool: ThreadPoolExecutor, fn: Callable[[Any], None], items: list[Any]) -> None:
        if not self.stop.is_set():
            list(pool.map(fn, items))

    def _requeue_loop(self) -> None:
        while not self.stop.is_set():
            if not self.requeue.wait(1.0):
                continue
            self.stop.wait(COALESCE_S)  # let a burst of child events collapse into one key
            keys = [k for k in self.requeue.drain() if k[1]]

            def fetch_and_reconcile(key: tuple[str, str]) -> None:
                try:
                    obj = self.kube.get(KIND, *key)
                except Exception:
                    self.logger.exception("fetching %s/%s failed", *key)
                    return
                if obj is not None:
                    self.reconcile_body(obj)

            self._map(self.event_pool, fetch_and_reconcile, keys)

    def _list_all(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        base = f"/apis/{GROUP}/{VERSION}"
        paths = [f"{base}/namespaces/{ns}/{PLURAL}" for ns in self.namespaces]
        for path in paths or [f"{base}/{PLURAL}"]:
            items += self.kube.request("GET", path).get("items", [])
        return items

    def resync_now(self) -> None:
        """Requeue every AtomDeployment (on becoming the leader)."""
        try:
            for obj in self._list_all():
                self.requeue.add(obj["metadata"]["namespace"], obj["metadata"]["name"])
        except Exception:
            self.logger.exception("listing AtomDeployments failed")
            if not self.stop.is_set():
                threading.Timer(1.0, self.resync_now).start()

    def _resync_loop(self) -> None:
        while not self.stop.wait(self.interval):
            if not self.leading:
                continue
            try:
                listed_since = time.monotonic()
                items = self._list_all()
                # What the listing no longer names was deleted (a missed delete event too).
                self.reconciler.retain({o["metadata"]["uid"] for o in items}, listed_since)
                # Objects an event reconciled within the interval are fresh already.
                stale = [
                    o
                    for o in items
                    if self.reconciler.seconds_since_reconcile(o["metadata"]["uid"])
                    >= self.interval
                ]
                self._map(self.resync_pool, self.reconcile_body, stale)
            except Exception:
                self.logger.exception("periodic reconcile pass failed")
