"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

Every replica watches and keeps its caches warm; only the holder of the Lease reconciles.
The holder renews every `renew_s`; the others take the Lease over once its record has not
changed for `lease_s` by their own clock (never comparing clocks across machines). A holder
that cannot renew within `renew_deadline_s` stops acting before anyone may take over, and a
graceful shutdown releases the Lease so the next replica takes over at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Protocol

from atom_operator.kube import ApiError, Kube
from atom_operator.logs import Logger


class Leadership(Protocol):
    """Whether this replica may act now."""

    @property
    def leading(self) -> bool: ...


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(
        self,
        kube: Kube,
        *,
        namespace: str,
        name: str,
        identity: str,
        lease_s: float = 15.0,
        renew_deadline_s: float = 10.0,
        renew_s: float = 2.0,
        on_elected: Callable[[], None] = lambda: None,
        logger: Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_s, self.renew_deadline_s, self.renew_s = lease_s, renew_deadline_s, renew_s
        self.on_elected = on_elected
        self.logger = logger or logging.getLogger(__name__)
        self.clock = clock
        self._leading = threading.Event()
        self._stop = threading.Event()
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self._renewed_at = 0.0

    @property
    def leading(self) -> bool:
        return self._leading.is_set()

    def _path(self, with_name: bool = True) -> str:
        return self.kube.path("Lease", self.namespace, self.name if with_name else None)

    def _body(self, lease: dict[str, Any] | None, transitions: int) -> dict[str, Any]:
        now = _now()
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.lease_s),
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if lease is None or lease.get("spec", {}).get("holderIdentity") != self.identity:
            spec["acquireTime"] = now
        else:
            spec["acquireTime"] = lease["spec"].get("acquireTime", now)
        if lease is not None:
            meta["resourceVersion"] = lease["metadata"]["resourceVersion"]  # optimistic lock
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": spec,
        }

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the Lease afterwards."""
        try:
            lease = self.kube.get("Lease", self.namespace, self.name)
            if lease is None:
                self.kube.request("POST", self._path(False), body=self._body(None, 0))
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime") or "")
            if record != self._observed:
                self._observed, self._observed_at = record, self.clock()
            duration = float(spec.get("leaseDurationSeconds") or self.lease_s)
            expired = self.clock() - self._observed_at >= duration
            if holder and holder != self.identity and not expired:
                return False
            transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
            self.kube.request("PUT", self._path(), body=self._body(lease, transitions))
            return True
        except ApiError as exc:
            if exc.status != 409:  # 409: another replica wrote first; try next round
                self.logger.warning("leader election: %s", exc.message)
            return False
        except Exception as exc:  # API unreachable: keep leading only until the deadline
            self.logger.warning("leader election: %s", exc)
            return False

    def step(self) -> None:
        if self.try_acquire_or_renew():
            self._renewed_at = self.clock()
            if not self.leading:
                self.logger.info("leader election: %s now leads (%s)", self.identity, self.name)
                self._leading.set()
                self.on_elected()
        elif self.leading and self.clock() - self._renewed_at >= self.renew_deadline_s:
            self.logger.warning("leader election: %s lost the lease; standing by", self.identity)
            self._leading.clear()

    def run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.renew_s)

    def start(self) -> None:
        threading.Thread(target=self.run, name="leader-election", daemon=True).start()

    def release(self) -> None:
        """Stop, and hand the Lease back so another replica takes over at once."""
        self._stop.set()
        if not self.leading:
            return
        self._leading.clear()
        try:
            lease = self.kube.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                body = self._body(lease, int(lease["spec"].get("leaseTransitions") or 0))
                body["spec"].update(holderIdentity="", leaseDurationSeconds=1)
                self.kube.request("PUT", self._path(), body=body)
        except Exception as exc:  # shutting down: the lease expires on its own
            self.logger.warning("leader election: release failed: %s", exc)


class AlwaysLeader:
    """Leader election off (ATOM_OPERATOR_LEADER_ELECTION=false): a single replica acts."""

    leading = True

    def start(self) -> None:
        return None

    def release(self) -> None:
        return None
