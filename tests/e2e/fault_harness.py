"""A fault harness for the operator on the real API server (issue 49): two replicas with a
write journal each, a process frozen mid-reconcile (fault_operator.py), a 0.1 s sampler of
who leads and of observedGeneration, and an API-server restart. Every wait is bounded.

The freeze window is ATOM_FAULT_FREEZE_S (default: the lease duration plus 2 s, the shortest
window in which the standby must take over); the lease ATOM_FAULT_LEASE_S (default 6 s).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from atomd_e2e import OperatorProcess

from atom_operator.kube import Kube
from testutil import wait_for

if TYPE_CHECKING:
    from atom_devtools.devcluster import LocalCluster

LEASE_S = float(os.environ.get("ATOM_FAULT_LEASE_S", "6"))
FREEZE_S = float(os.environ.get("ATOM_FAULT_FREEZE_S", str(LEASE_S + 2)))
SAMPLE_S = 0.1
WRAPPER = Path(__file__).with_name("fault_operator.py")


class Replica(OperatorProcess):
    """One operator replica under fault_operator.py: its journal and its freeze switch."""

    def __init__(self, env: dict[str, str], log_dir: Path, namespace: str, who: str) -> None:
        super().__init__(env, log_dir, namespace)
        self.who = who
        self.journal_path = log_dir / f"{who}.journal"
        self.arm_path = log_dir / f"{who}.arm"
        self.argv = [sys.executable, str(WRAPPER)]
        self.starts = {"op-a": 10, "op-b": 20}.get(who, 30)  # separate log files
        self.env.update(
            ATOM_OPERATOR_IDENTITY=who,
            ATOM_OPERATOR_LEASE_NAME="ha",
            ATOM_OPERATOR_LEASE_SECONDS=str(LEASE_S),
            ATOM_OPERATOR_RECONCILE_INTERVAL="600",  # events, retries and elections only
            ATOM_FAULT_JOURNAL=str(self.journal_path),
            ATOM_FAULT_FREEZE_ARM=str(self.arm_path),
        )

    def leading(self) -> bool | None:
        """What the replica's /metrics says (None: no answer, or stopped: a frozen process
        acts on nothing until it wakes, and then asks its clock first)."""
        if self.proc is None or self.proc.poll() is not None or self.stopped():
            return None
        url = f"http://127.0.0.1:{self.env['ATOM_OPERATOR_METRICS_PORT']}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=0.5) as r:
                text = r.read().decode()
        except OSError:
            return None
        found = re.search(r"^atom_operator_leader (\d)", text, re.M)
        return found is not None and found.group(1) == "1"

    def arm_freeze(self, instance: str) -> None:
        self.arm_path.write_text(instance)

    def stopped(self) -> bool:
        """Whether the process is stopped by a signal (state T in /proc)."""
        assert self.proc is not None
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] == "T"

    def cont(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def journal(self) -> list[dict[str, Any]]:
        if not self.journal_path.exists():
            return []
        return [json.loads(line) for line in self.journal_path.read_text().splitlines() if line]

    def log(self) -> str:
        path = self.log_dir / f"operator-{self.starts}.log"
        return path.read_text() if path.exists() else ""


@dataclass
class Sample:
    t: float
    leaders: list[str]
    observed_generation: int | None
    present: dict[str, bool]  # watched child names -> exists


@dataclass
class Sampler:
    """Every SAMPLE_S: which replicas say they lead, the object's observedGeneration, and
    whether each watched Deployment exists. Runs in a thread between start() and stop()."""

    kube: Kube
    replicas: list[Replica]
    namespace: str
    name: str
    watched: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Sampler:
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        return self.samples

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                self.samples.append(self._sample())
            except Exception:  # the API server restarting: no sample this round
                pass
            self._stop.wait(max(0.0, SAMPLE_S - (time.monotonic() - began)))

    def _sample(self) -> Sample:
        leaders = [r.who for r in self.replicas if r.proc and r.proc.poll() is None and r.leading()]
        obj = self.kube.get("AtomDeployment", self.namespace, self.name)
        gen = ((obj or {}).get("status") or {}).get("observedGeneration")
        present = {
            n: self.kube.get("Deployment", self.namespace, n) is not None for n in self.watched
        }
        return Sample(time.time(), leaders, gen, present)


def generations_never_go_back(samples: list[Sample]) -> None:
    seen = [s.observed_generation for s in samples if s.observed_generation is not None]
    backwards = [(a, b) for a, b in zip(seen, seen[1:], strict=False) if b < a]
    assert not backwards, f"observedGeneration went backwards: {backwards}"


def never_two_leaders(samples: list[Sample]) -> None:
    double = [(s.t, s.leaders) for s in samples if len(s.leaders) > 1]
    assert not double, f"two leaders in one sample: {double[:5]}"


def lease_holder(kube: Kube, namespace: str) -> str:
    lease = kube.get("Lease", namespace, "ha") or {}
    return (lease.get("spec") or {}).get("holderIdentity") or ""


def wait_leader(kube: Kube, namespace: str, replicas: list[Replica], timeout: float) -> Replica:
    """The replica that holds the Lease and says it leads."""

    def one() -> Replica | None:
        holder = lease_holder(kube, namespace)
        return next((r for r in replicas if r.who == holder and r.leading()), None)

    return wait_for("a leader", one, timeout=timeout)


def restart_apiserver(cluster: LocalCluster, down_s: float = 1.0) -> None:
    """Stop kube-apiserver (SIGTERM; SIGKILL after 10 s: its graceful shutdown can wait a
    minute on open watches), keep it down `down_s`, start it with the same flags, and wait
    for /readyz. Other components and clients reconnect on their own."""
    (proc,) = [p for p in cluster.procs if p.name == "kube-apiserver"]
    proc.signal(signal.SIGTERM)
    if not proc.wait(10):
        proc.signal(signal.SIGKILL)
        assert proc.wait(10), "kube-apiserver did not stop"
    time.sleep(down_s)  # down on purpose: the fault, not a wait for a condition
    proc.start()
    api = cluster.api
    assert api is not None
    wait_for("kube-apiserver /readyz", lambda: api.get("/readyz")[0] == 200, timeout=120)
