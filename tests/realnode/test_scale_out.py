"""Scale-out measured on the real node: SmolLM2 on CPU pods, KEDA and the HPA of the local
cluster, the operator installed by its chart. A bounded load generator (threads on this host,
to the endpoint Service's ClusterIP) queues requests past the target; the HPA adds a pod; the
load stops and the HPA removes it after the stabilization window, with no request failed.

Timed from the spike: the HPA's decision, the new pod Ready, the new pod's first generated
token, with the compile cache on the claim warm (the first pod filled it). The suite runs that
round only; ATOM_SCALE_OUT_COLD=1 adds the round with no cache (every pod compiles), the
comparison bench/RESULTS.md records. This module brings its own real node (KEDA needs the API server's
front-proxy flags), so it runs before the session's real cluster starts.

Run under the real-node lock: flock /tmp/atom-realnode.lock .venv/bin/pytest -s ... (-s prints
the numbers).
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from realnode_helpers import (
    EXAMPLE,
    NAMESPACE,
    apply,
    atomd,
    chart_operator,
    pod_ready,
    running_real_cluster,
    runtime_pods,
)

from atom_devtools.kubectl import Kubectl, is_ready
from atom_operator import naming
from atom_operator.builders.autoscaling import hpa_name
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.own_real_node, pytest.mark.slow]

READY_TIMEOUT = 900
WORKERS = 12  # concurrent streams: maxNumSeqs 8 run, the rest wait in the engine
# Bound on a round's requests. A round sends about 10 a second until the new pod serves: a
# cold pod compiling for minutes outlasted 600 (the load ran dry, no request reached it).
MAX_REQUESTS = 6000
POLICY = {"minReplicas": 1, "maxReplicas": 2, "target": 2,
          "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 30}  # fmt: skip


@pytest.fixture(scope="module")
def keda_cluster(real_images: dict[str, Any]) -> Iterator[Any]:
    from atom_devtools.devcluster import ProvisionError
    from atom_devtools.devcluster.addons import wait_installed

    try:
        wait_installed("keda")
    except ProvisionError as exc:
        pytest.fail(str(exc), pytrace=False)
    yield from running_real_cluster(real_images, keda=True)


@pytest.fixture(scope="module")
def kube_ctl(keda_cluster: Any, real_images: dict[str, Any]) -> Kubectl:
    return chart_operator(keda_cluster, real_images)


def manifest(name: str, cache: bool) -> dict[str, Any]:
    out = copy.deepcopy(EXAMPLE)
    out["metadata"] = {"name": name, "namespace": NAMESPACE}
    out["spec"]["compilation"] = {"level": 3, "useInductor": True}
    out["spec"]["compileCache"] = {**out["spec"]["compileCache"], "enabled": cache}
    out["spec"]["autoscaling"] = POLICY
    out["spec"]["replicas"] = 1  # the scale subresource needs it; the HPA's from then on
    return out


@dataclass
class Load:
    """Worker threads posting completions to one URL until stopped or MAX_REQUESTS sent."""

    url: str
    model: str
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    sent: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self, workers: int) -> None:
        self._stop.clear()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "prompt": "Tell me a story about a cat.",
                           "max_tokens": 48, "temperature": 0.0}).encode()  # fmt: skip
        while not self._stop.is_set():
            with self._lock:
                if self.sent >= MAX_REQUESTS:
                    return
                self.sent += 1
            req = urllib.request.Request(f"{self.url}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=300) as resp:
                    resp.read()
                with self._lock:
                    self.ok += 1
            except (urllib.error.URLError, OSError) as exc:
                with self._lock:
                    self.failed.append(repr(exc))


def generated_tokens(pod: dict[str, Any]) -> float:
    try:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics",
                                    timeout=5) as resp:  # fmt: skip
            text = resp.read().decode()
    except OSError:
        return 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "atom_generation_tokens":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    return 0.0


def scale_out_round(kubectl: Kubectl, name: str, cache: bool) -> dict[str, float]:
    apply(kubectl, manifest(name, cache))
    wait_for(f"atomd/{name} Ready with one pod", lambda: is_ready(atomd(kubectl, name))
             and [p for p in runtime_pods(kubectl, name) if pod_ready(p)],
             timeout=READY_TIMEOUT, interval=2)  # fmt: skip
    first = {p["metadata"]["name"] for p in runtime_pods(kubectl, name)}
    hpa = hpa_name(name, naming.UNIFIED)
    wait_for("KEDA's HPA reading the metric", lambda: kubectl.json(
        "hpa", hpa, "-n", NAMESPACE).get("status", {}).get("currentMetrics"), timeout=120)
    svc = kubectl.json("service", name, "-n", NAMESPACE)
    load = Load(f"http://{svc['spec']['clusterIP']}:8000", EXAMPLE["spec"]["model"]["name"])
    t0 = time.monotonic()
    load.start(WORKERS)
    try:
        wait_for("the HPA to ask for 2 pods", lambda: kubectl.json(
            "hpa", hpa, "-n", NAMESPACE).get("status", {}).get("desiredReplicas", 0) >= 2,
            timeout=300)  # fmt: skip
        decided = time.monotonic() - t0
        new = wait_for("a second pod Ready", lambda: next(
            (p for p in runtime_pods(kubectl, name)
             if p["metadata"]["name"] not in first and pod_ready(p)), None),
            timeout=READY_TIMEOUT, interval=1)  # fmt: skip
        ready = time.monotonic() - t0
        wait_for("the new pod's first token", lambda: generated_tokens(new) > 0,
                 timeout=300, interval=0.5)  # fmt: skip
        first_token = time.monotonic() - t0
    finally:
        load.stop()
    # The load stops; a trickle (below the target) runs through the scale-down: the removed
    # pod drains and no request fails.
    stopped = time.monotonic()
    trickle = Load(load.url, load.model)
    trickle.start(1)
    try:
        wait_for("the HPA back to 1 pod", lambda: atomd(kubectl, name)["spec"].get(
            "replicas") == 1 and len(runtime_pods(kubectl, name)) == 1,
            timeout=300, interval=1)  # fmt: skip
        scaled_down = time.monotonic() - stopped
        time.sleep(5)  # requests sent while the removed pod's endpoint was dropping complete
    finally:
        trickle.stop()
    kubectl("delete", "atomd", name, "-n", NAMESPACE, "--wait=false", check=False)
    assert load.failed == [] and trickle.failed == [], (load.failed + trickle.failed)[:5]
    assert load.ok > 0 and trickle.ok > 0
    return {"hpa_decision_s": decided, "new_pod_ready_s": ready,
            "new_pod_first_token_s": first_token, "scale_down_after_load_s": scaled_down,
            "requests_ok": load.ok + trickle.ok, "requests_failed": 0}  # fmt: skip


def test_scale_out_and_back_with_no_failed_request(kube_ctl: Kubectl) -> None:
    results = {"warm": scale_out_round(kube_ctl, "scale-warm", cache=True)}
    print("\nscale-out, warm cache (seconds from the spike):", json.dumps(results["warm"]),
          flush=True)  # fmt: skip
    if os.environ.get("ATOM_SCALE_OUT_COLD") == "1":  # the measurement, several minutes more
        results["cold"] = scale_out_round(kube_ctl, "scale-cold", cache=False)
        print("\nscale-out (seconds from the spike):", json.dumps(results, indent=1))
