"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it,
with fenced writes.

Every replica watches and keeps its caches warm; only the holder of the Lease reconciles.
The holder renews every `renew_s`; the others take the Lease over once its record has not
changed for `lease_s` by their own clock (never comparing clocks across machines). A graceful
shutdown releases the Lease so the next replica takes over at once.

Fencing (issue 49): `leading` is not a flag that only the election thread clears. It is derived,
at every call, from when the last successful renewal began: a holder whose last renewal began
`renew_deadline_s` ago or more (a lost API server, or a process frozen by SIGSTOP, a GC pause,
CPU throttling or a paused VM) no longer leads, before anyone else may take over (`lease_s` >
`renew_deadline_s`). Each acquisition starts a new term, and a reconcile writes through the
`fence()` of the term it began in (`kube.Kube.fenced`): a reconcile that outlives its term, even
one whose replica has been elected again since, writes nothing more. The holder stands down at
once when the Lease names another holder or is gone; a Lease that is gone is taken over only
once the record last seen in it would have expired, so a deleted Lease never makes two leaders.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from atom_operator.kube import ApiError, Fence, Kube, NotLeading
from atom_operator.logs import Logger


class Leadership(Protocol):
    """Whether this replica may act now, and the write fence of the current term."""

    @property
    def leading(self) -> bool: ...

    def fence(self) -> Fence: ...


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Round(enum.Enum):
    """What one election round learned."""

    HELD = "held"  # this replica holds the Lease, renewed now
    OTHER = "other"  # another replica holds it, or it is gone and may not be taken yet
    UNKNOWN = "unknown"  # the API server did not answer: nothing learned


@dataclass(frozen=True)
class TermFence:
    """Writes allowed while `elector` leads in `term` (the term a reconcile began in)."""

    elector: LeaderElector
    term: int

    def check(self) -> None:
        if not self.elector.holds(self.term):
            raise NotLeading(f"{self.elector.identity} no longer leads (term {self.term})")


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
        if renew_deadline_s >= lease_s:
            raise ValueError("the renew deadline must end before the lease does")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.lease_s, self.renew_deadline_s, self.renew_s = lease_s, renew_deadline_s, renew_s
        self.on_elected = on_elected
        self.logger = logger or logging.getLogger(__name__)
        self.clock = clock
        self._lock = threading.Lock()  # guards _held, _term, _renewed_at
        self._held = False
        self._term = 0  # acquisitions so far; a fence names one
        self._renewed_at = float("-inf")  # when the last successful round began
        self._stop = threading.Event()
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0
        self.last_holder = ""  # the holder the last answered round saw ("" none)

    @property
    def leading(self) -> bool:
        with self._lock:
            return self._leading_locked()

    def _leading_locked(self) -> bool:
        return self._held and self.clock() - self._renewed_at < self.renew_deadline_s

    def holds(self, term: int) -> bool:
        """Whether this replica leads now, in `term`."""
        with self._lock:
            return self._term == term and self._leading_locked()

    def fence(self) -> Fence:
        """The fence of the current term: a reconcile takes it when it begins."""
        with self._lock:
            return TermFence(self, self._term)

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

    def _expired(self, duration: float) -> bool:
        """Whether the record last seen has stood still for `duration` by this replica's clock."""
        return self.clock() - self._observed_at >= duration

    def try_acquire_or_renew(self) -> Round:
        """One round against the Lease."""
        try:
            lease = self.kube.get("Lease", self.namespace, self.name)
            if lease is None:
                self.last_holder = ""
                # Gone (deleted by hand, or never made). A holder seen in it may still act
                # until its own deadline: wait until its record would have expired.
                if self._observed is not None and not self._expired(self.lease_s):
                    return Round.OTHER
                self.kube.request("POST", self._path(False), body=self._body(None, 0))
                return Round.HELD
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            self.last_holder = holder
            record = (holder, spec.get("renewTime") or "")
            if record != self._observed:
                self._observed, self._observed_at = record, self.clock()
            duration = float(spec.get("leaseDurationSeconds") or self.lease_s)
            if holder and holder != self.identity and not self._expired(duration):
                return Round.OTHER
            transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
            self.kube.request("PUT", self._path(), body=self._body(lease, transitions))
            return Round.HELD
        except ApiError as exc:
            if exc.status == 409:  # another replica wrote first: it holds the Lease now
                return Round.OTHER
            self.logger.warning("leader election: %s", exc.message)
            return Round.UNKNOWN
        except Exception as exc:  # API unreachable: keep leading only until the deadline
            self.logger.warning("leader election: %s", exc)
            return Round.UNKNOWN

    def step(self) -> None:
        began = self.clock()  # a renewal counts from when it began, never from its answer
        result = self.try_acquire_or_renew()
        elected = False
        with self._lock:
            was = self._leading_locked()
            if result is Round.HELD:
                self._renewed_at = began
                if not was:  # a new term, even after a lapse: older fences stay closed
                    self._held, self._term, elected = True, self._term + 1, True
            elif self._held and (result is Round.OTHER or not was):
                self._held = False
                why = (
                    f"the Lease is held by {self.last_holder}"
                    if self.last_holder
                    else "the Lease is gone"
                )
                if result is Round.UNKNOWN:
                    why = f"no renewal for {self.renew_deadline_s:.0f}s"
                self.logger.warning("leader election: %s stands down (%s)", self.identity, why)
        if elected:
            self.logger.info("leader election: %s now leads (%s)", self.identity, self.name)
            self.on_elected()

    def run(self) -> None:
        while not self._stop.is_set():
            self.step()
            self._stop.wait(self.renew_s)

    def start(self) -> None:
        threading.Thread(target=self.run, name="leader-election", daemon=True).start()

    def release(self) -> None:
        """Stop, and hand the Lease back so another replica takes over at once."""
        self._stop.set()
        with self._lock:
            was, self._held = self._leading_locked(), False
        if not was:
            return
        try:
            lease = self.kube.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                body = self._body(lease, int(lease["spec"].get("leaseTransitions") or 0))
                body["spec"].update(holderIdentity="", leaseDurationSeconds=1)
                self.kube.request("PUT", self._path(), body=body)
        except Exception as exc:  # shutting down: the lease expires on its own
            self.logger.warning("leader election: release failed: %s", exc)


class _Open:
    """The fence of a replica that always leads."""

    def check(self) -> None:
        return None


class AlwaysLeader:
    """Leader election off (ATOM_OPERATOR_LEADER_ELECTION=false): a single replica acts."""

    leading = True

    def fence(self) -> Fence:
        return _Open()

    def start(self) -> None:
        return None

    def release(self) -> None:
        return None
