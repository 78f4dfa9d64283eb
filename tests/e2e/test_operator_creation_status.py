"""Status truth while objects are created, and children restored by events (issue 49), on the
real API server with one operator whose periodic resync is 10 minutes away.

- a pod waiting for the claim the operator just created is Progressing: 0 Degraded samples
  (every 0.1 s) and 0 Warning events while the claim binds;
- a pod that cannot fit turns Degraded(Unschedulable) within the grace period plus a few s;
- a child whose managed-by label is edited is restored within seconds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from atomd_e2e import (
    Kubectl,
    OperatorProcess,
    atomd,
    condition,
    get,
    is_ready,
    pre_bound_pv,
    running_operator,
)

from atom_operator import naming, problems
from atom_operator.kube import Kube
from testutil import wait_for

NS, SC, TIMEOUT = "atomd-creation", "atomd-creation-manual", 90
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, env: dict[str, str], tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator")
    with running_operator(kubectl, env, log, NS, ATOM_OPERATOR_RECONCILE_INTERVAL="600") as op:
        yield op


def _spec(**extra: Any) -> dict[str, Any]:
    return {
        "model": {"name": "tiny-llama", "loadFormat": "dummy"},
        "engine": {"maxNumSeqs": 16},
        "compileCache": {"enabled": False},
        **extra,
    }


def _warnings(kubectl: Kubectl, name: str) -> list[dict[str, Any]]:
    out = kubectl(
        "get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    ).stdout
    return [e for e in json.loads(out)["items"] if e["type"] == "Warning"]


def _unschedulable(kube: Kube, name: str, words: str) -> dict[str, Any] | None:
    for pod in kube.list("Pod", NS, naming.selector_string(naming.selector_labels(name))):
        for cond in pod.get("status", {}).get("conditions") or []:
            if cond["type"] == "PodScheduled" and words in cond.get("message", ""):
                return cond
    return None


class DegradedSampler:
    """Degraded=True samples of one object, every 0.1 s, until stopped."""

    def __init__(self, kube: Kube, name: str) -> None:
        self.kube, self.name, self.degraded = kube, name, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.1):
            d = condition(get(self.kube, NS, self.name), "Degraded")
            if d.get("status") == "True":
                self.degraded.append(d)

    def done(self) -> list[dict[str, Any]]:
        self.stop.set()
        self.thread.join(10)
        return self.degraded


def test_a_claim_that_binds_after_the_pod_is_made_is_progressing(
    operator, kubectl, kube, tmp_path
) -> None:
    claim = naming.pvc_name("binding")
    spec = _spec(compileCache={"storageClassName": SC, "size": "1Gi"})
    kubectl.apply(atomd("binding", NS, spec))
    sampler = DegradedSampler(kube, "binding")
    try:
        # the transient the campaign saw: the scheduler waits for the claim to bind
        wait_for(
            "the pod waits for its claim",
            lambda: _unschedulable(kube, "binding", "unbound immediate PersistentVolumeClaims"),
            timeout=TIMEOUT,
        )
        wait_for(
            "Progressing quotes the scheduler",
            lambda: (
                "waits for its claim to bind"
                in condition(get(kube, NS, "binding"), "Progressing").get("message", "")
            ),
            timeout=10,
        )
        time.sleep(3)  # binding takes a moment: a provisioner, or here a person
        kubectl.apply(pre_bound_pv(f"{NS}-binding", NS, claim, SC, tmp_path))
        wait_for("binding Ready", lambda: is_ready(get(kube, NS, "binding")), timeout=TIMEOUT)
    finally:
        degraded = sampler.done()
    assert degraded == [], degraded
    assert _warnings(kubectl, "binding") == []
    kubectl("delete", "atomd", "binding", "-n", NS, "--wait=true", "--timeout=60s", check=False)


def test_a_pod_that_cannot_fit_is_degraded_after_the_grace_period(operator, kubectl, kube) -> None:
    grace = problems.SCHEDULING_GRACE.total_seconds()
    kubectl.apply(atomd("nofit", NS, _spec(resources={"requests": {"cpu": "900"}})))
    wait_for(
        "the scheduler finds no node",
        lambda: _unschedulable(kube, "nofit", "Insufficient cpu"),
        timeout=TIMEOUT,
    )
    seen = time.monotonic()
    assert condition(get(kube, NS, "nofit"), "Degraded").get("status") != "True"

    def degraded() -> dict[str, Any] | None:
        d = condition(get(kube, NS, "nofit"), "Degraded")
        return d if d.get("status") == "True" else None

    d = wait_for("nofit Degraded", degraded, timeout=grace + 10, interval=0.2)
    assert d["reason"] == "Unschedulable" and "Insufficient cpu" in d["message"], d
    assert time.monotonic() - seen <= grace + 6  # grace + the recheck + one reconcile
    assert [e["reason"] for e in _warnings(kubectl, "nofit")].count("Unschedulable") == 1
    kubectl("delete", "atomd", "nofit", "-n", NS, "--wait=true", "--timeout=60s", check=False)


@pytest.mark.parametrize("kind", ["service", "configmap"])
def test_a_child_whose_managed_by_label_is_edited_is_restored_within_seconds(
    operator, kubectl, kube, kind: str
) -> None:
    name = f"label-{kind}"
    kubectl.apply(atomd(name, NS, _spec()))
    wait_for(f"{name} Ready", lambda: is_ready(get(kube, NS, name)), timeout=TIMEOUT)
    child = name if kind == "service" else naming.config_map_name(name)
    api_kind = "Service" if kind == "service" else "ConfigMap"
    edited = time.monotonic()
    kubectl("label", kind, child, "-n", NS, f"{naming.LABEL_MANAGED_BY}=someone", "--overwrite")
    wait_for(
        f"{kind} label restored",
        lambda: (
            kube.get(api_kind, NS, child)["metadata"]["labels"][naming.LABEL_MANAGED_BY]
            == naming.MANAGED_BY
        ),
        timeout=10,
        interval=0.2,
    )
    assert time.monotonic() - edited < 10  # events, not the resync (600 s)
    kubectl("delete", "atomd", name, "-n", NS, "--wait=true", "--timeout=60s", check=False)
