"""Two operator replicas under faults on the real API server (issue 49), through the fault
harness (fault_harness.py): a leader frozen mid-reconcile wakes after the standby took over;
the Lease is deleted; the API server restarts during a handover.

What must hold: no stale child is created, observedGeneration never goes backwards (sampled
every 0.1 s), a replica that woke writes nothing until it holds the Lease again, and never do
two replicas lead in the same 0.1 s sample.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from atomd_e2e import Kubectl, atomd, get, install_crd, is_ready
from fault_harness import (
    FREEZE_S,
    LEASE_S,
    Replica,
    Sampler,
    generations_never_go_back,
    lease_holder,
    never_two_leaders,
    restart_apiserver,
    wait_leader,
)

from atom_operator import naming
from atom_operator.kube import Kube
from testutil import wait_for

NS, TIMEOUT = "atomd-ha-faults", 90
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _spec(max_num_seqs: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "model": {"name": "tiny-llama", "loadFormat": "dummy"},
        "engine": {"maxNumSeqs": max_num_seqs},
        "compileCache": {"enabled": False},
        **extra,
    }


PD = {"prefill": {"replicas": 1}, "decode": {"replicas": 1}, "router": {"replicas": 1}}


@pytest.fixture(scope="module")
def replicas(kubectl: Kubectl, env: dict[str, str], tmp_path_factory) -> Iterator[list[Replica]]:
    install_crd(kubectl)
    kubectl("create", "namespace", NS, check=False)
    log = tmp_path_factory.mktemp("ha-faults")
    ops = [Replica(env, log, NS, who) for who in ("op-a", "op-b")]
    for op in ops:
        op.start()
    try:
        yield ops
    finally:
        for op in ops:
            if op.proc is not None and op.proc.poll() is None:
                op.cont()  # a stopped process ignores SIGTERM until continued
            op.stop()
        kubectl("delete", "atomd", "--all", "-n", NS, "--wait=false", check=False)


def _running(replicas: list[Replica]) -> list[Replica]:
    return [r for r in replicas if r.proc is not None and r.proc.poll() is None]


def _ready_at(kube: Kube, name: str, generation: int) -> dict[str, Any] | None:
    obj = get(kube, NS, name)
    return obj if is_ready(obj) and obj["metadata"]["generation"] == generation else None


def _patch(kubectl: Kubectl, name: str, spec: dict[str, Any]) -> None:
    kubectl.apply(atomd(name, NS, spec))


def test_a_leader_frozen_mid_reconcile_wakes_and_writes_nothing(replicas, kubectl, kube) -> None:
    leader = wait_leader(kube, NS, replicas, timeout=30)
    (standby,) = [r for r in replicas if r is not leader]
    _patch(kubectl, "frozen", _spec(disaggregation=PD))
    wait_for("frozen Ready", lambda: _ready_at(kube, "frozen", 1), timeout=TIMEOUT)

    # The leader stops itself at the first apply of the next revision's Deployments.
    leader.arm_freeze("frozen")
    _patch(kubectl, "frozen", _spec(8, disaggregation=PD))  # generation 2
    wait_for("the leader frozen mid-reconcile", leader.stopped, timeout=30)
    frozen_at = time.monotonic()
    (stale,) = [e["frozen"] for e in leader.journal() if "frozen" in e]
    assert naming.PREFILL in stale or naming.DECODE in stale or naming.ROUTER in stale, stale
    stale_generation = get(kube, NS, "frozen")["metadata"]["generation"]
    sampler = Sampler(kube, replicas, NS, "frozen", watched=[stale]).start()
    try:
        # The spec moves on while the leader sleeps; the standby takes over and serves it.
        _patch(kubectl, "frozen", _spec(4, disaggregation=PD))  # generation 3
        wait_for("the standby leads", lambda: lease_holder(kube, NS) == standby.who, timeout=30)
        wait_for("generation 3 Ready", lambda: _ready_at(kube, "frozen", 3), timeout=TIMEOUT)
        assert kube.get("Deployment", NS, stale) is None
        time.sleep(max(0.0, FREEZE_S - (time.monotonic() - frozen_at)))  # the freeze window
        resumed = time.time()
        leader.cont()
        wait_for(
            "the woken replica abandons its reconcile",
            lambda: "abandoned" in leader.log() and "stands down" in leader.log(),
            timeout=20,
        )
        time.sleep(2 * LEASE_S / 3)  # a renew deadline's worth of chances to write anything
    finally:
        samples = sampler.stop()
    assert stale_generation == 2
    written = [e for e in leader.journal() if e["t"] > resumed and "method" in e]
    assert all(e.get("refused") for e in written), f"the woken replica wrote: {written}"
    assert any(e.get("refused") for e in written)  # its in-flight apply was refused
    assert not any(s.present[stale] for s in samples), "a stale child was created"
    generations_never_go_back(samples)
    never_two_leaders(samples)
    obj = _ready_at(kube, "frozen", 3)
    assert obj is not None and obj["status"]["observedGeneration"] == 3
    assert len([s for s in samples if s.observed_generation is not None]) > 10 * FREEZE_S / 2

    # It writes again only once it holds the Lease again: the standby goes away for good.
    standby.kill()
    killed = time.time()
    wait_for("the woken replica leads again", lambda: leader.leading(), timeout=LEASE_S + 15)
    _patch(kubectl, "frozen", _spec(2, disaggregation=PD))  # generation 4
    wait_for("generation 4 Ready", lambda: _ready_at(kube, "frozen", 4), timeout=TIMEOUT)
    after = [e for e in leader.journal() if e["t"] > killed and "method" in e]
    first_child = next(i for i, e in enumerate(after) if "/leases" not in e["path"])
    assert any("/leases" in e["path"] and not e.get("refused") for e in after[:first_child])
    standby.start()  # back to two replicas for the next tests


def test_deleting_the_lease_never_gives_two_leaders(replicas, kubectl, kube) -> None:
    leader = wait_leader(kube, NS, _running(replicas), timeout=30)
    _patch(kubectl, "lease", _spec())
    sampler = Sampler(kube, _running(replicas), NS, "lease").start()
    try:
        time.sleep(1)  # a few samples with one leader first
        deleted = time.monotonic()
        kubectl("delete", "lease", "ha", "-n", NS)
        wait_for("the old leader stands down", lambda: leader.leading() is False, timeout=5)
        assert time.monotonic() - deleted < 2 + 2  # one renew period, not the renew deadline
        wait_leader(kube, NS, _running(replicas), timeout=LEASE_S + 10)
        _patch(kubectl, "lease", _spec(8))  # the new leader acts
        wait_for("lease Ready", lambda: _ready_at(kube, "lease", 2), timeout=TIMEOUT)
    finally:
        samples = sampler.stop()
    never_two_leaders(samples)
    generations_never_go_back(samples)
    assert any(not s.leaders for s in samples)  # the handover waited for the lease to lapse


def test_an_api_server_restart_during_a_handover_converges(
    replicas, cluster, kubectl, kube
) -> None:
    live = _running(replicas)
    leader = wait_leader(kube, NS, live, timeout=30)
    (survivor,) = [r for r in live if r is not leader]
    _patch(kubectl, "restart", _spec())
    wait_for("restart Ready", lambda: _ready_at(kube, "restart", 1), timeout=TIMEOUT)
    sampler = Sampler(kube, live, NS, "restart").start()
    try:
        leader.kill()  # the handover begins ...
        restart_apiserver(cluster)  # ... and the API server goes away in the middle of it
        _patch(kubectl, "restart", _spec(8, replicas=2))
        wait_for(
            "the survivor leads and serves generation 2",
            lambda: lease_holder(kube, NS) == survivor.who and _ready_at(kube, "restart", 2),
            timeout=TIMEOUT,
        )
    finally:
        samples = sampler.stop()
    never_two_leaders(samples)
    generations_never_go_back(samples)
    assert get(kube, NS, "restart")["status"]["roles"]["unified"]["readyReplicas"] == 2
