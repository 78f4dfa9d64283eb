"""What the kubelet and the API server do with the operator's pods when things go wrong on a
real node: a hung engine loop restarted by the liveness probe the operator renders, and a node
drain held by the PodDisruptionBudget it renders for two replicas.

Both use level 0 and no compile cache (nothing here depends on compile): the pods start in
seconds, so the timings below are the probes' and the drain's own.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest
import realnode_helpers as rn

from atom_devtools.devcluster.realnode import NODE_NAME
from atom_devtools.kubectl import Kubectl, is_ready
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.slow]


def eager(name: str, replicas: int) -> dict[str, Any]:
    manifest = copy.deepcopy(rn.EXAMPLE)
    manifest["metadata"] = {"name": name, "namespace": rn.NAMESPACE}
    manifest["spec"]["compilation"] = {"level": 0}
    manifest["spec"]["compileCache"] = {"enabled": False}
    manifest["spec"]["replicas"] = replicas
    return manifest


def ready_pods(kubectl: Kubectl, name: str, count: int) -> list[dict[str, Any]]:
    pods = rn.runtime_pods(kubectl, name)
    return pods if len(pods) == count and all(map(rn.pod_ready, pods)) else []


def restarts(pod: dict[str, Any]) -> int:
    return sum(s["restartCount"] for s in pod["status"].get("containerStatuses", []))


def pod_exec(kubectl: Kubectl, pod: dict[str, Any], code: str) -> str:
    """Python in the runtime container (the image has no kill or ps binary)."""
    name = pod["metadata"]["name"]
    return kubectl("exec", "-n", rn.NAMESPACE, name, "-c", "runtime", "--", "python3", "-c",
                   code).stdout.strip()  # fmt: skip


HANG = "tiny-cpu-hang"


def test_a_hung_engine_loop_is_restarted_by_the_liveness_probe(
    operator_release: str, kubectl: Kubectl
) -> None:
    rn.apply(kubectl, eager(HANG, 1))
    try:
        pod = wait_for(
            "the pod to be Ready",
            lambda: ready_pods(kubectl, HANG, 1),
            timeout=300,
        )[0]
        probe = pod["spec"]["containers"][0]["livenessProbe"]
        assert probe["httpGet"]["path"] == "/livez", probe  # what the operator renders
        url = f"http://{pod['status']['podIP']}:8000"
        assert rn.http_json(f"{url}/livez")[0] == 200
        core = rn.status_of(pod)["core_pid"]
        assert core, "no core_pid in /status"
        before = restarts(pod)
        # SIGSTOP: the engine core stays alive (so not "the core is gone") but its loop and
        # heartbeat stop, which is what a hung step looks like from the API server.
        stopped = time.monotonic()
        pod_exec(kubectl, pod, f"import os, signal; os.kill({core}, signal.SIGSTOP)")
        state = pod_exec(kubectl, pod, f"print(open('/proc/{core}/status').read())")
        assert "State:\tT (stopped)" in state, state

        # the runtime's --liveness-timeout (60 s by default; the operator keeps it)
        def livez_failed() -> Any:
            code, body = rn.http_json(f"{url}/livez")
            return body if code == 503 else None

        body = wait_for("/livez to fail", livez_failed, timeout=150, interval=2)
        livez_failed_s = time.monotonic() - stopped
        assert "hung" in body["reason"], body
        assert livez_failed_s > 50, f"/livez failed {livez_failed_s:.0f}s after the stop"

        def restarted() -> dict[str, Any] | None:
            pods = rn.runtime_pods(kubectl, HANG)
            return pods[0] if pods and restarts(pods[0]) > before else None

        # three failed probes 10 s apart, then the kubelet stops the container (preStop, the
        # runtime kills its stopped core after 10 s) and starts it again
        again = wait_for("the container to restart", restarted, timeout=240, interval=2)
        restarted_s = time.monotonic() - stopped
        assert again["metadata"]["uid"] == pod["metadata"]["uid"]  # the same pod, not a new one
        again = wait_for(
            "the pod to be Ready again",
            lambda: next((p for p in rn.runtime_pods(kubectl, HANG) if rn.pod_ready(p)), None),
            timeout=300,
        )  # fmt: skip
        ready_s = time.monotonic() - stopped
        assert rn.http_json(f"{url}/livez")[0] == 200
        status = rn.status_of(again)
        assert status["state"] == "ready" and status["core_pid"], status
        events = kubectl.json("events", "-n", rn.NAMESPACE, "--field-selector",
                              f"involvedObject.name={pod['metadata']['name']}")["items"]  # fmt: skip
        said = [f"{e['reason']}: {e['message']}" for e in events]
        assert any(s.startswith("Unhealthy: Liveness probe failed") for s in said), said
        assert any(s.startswith("Killing:") and "liveness" in s for s in said), said
        print(f"\nhung core: /livez 503 after {livez_failed_s:.0f}s, restarted after "
              f"{restarted_s:.0f}s, Ready again after {ready_s:.0f}s")  # fmt: skip
    finally:
        kubectl("delete", "atomd", HANG, "-n", rn.NAMESPACE, "--wait=false", check=False)


PDB = "tiny-cpu-pdb"
BUDGET_VIOLATION = "would violate the pod's disruption budget"


def disruptions_allowed(kubectl: Kubectl) -> int | None:
    return (
        kubectl.json("pdb", f"{PDB}-unified", "-n", rn.NAMESPACE)
        .get("status", {})
        .get("disruptionsAllowed")
    )


def test_a_node_drain_stops_at_the_disruption_budget(
    operator_release: str, kubectl: Kubectl
) -> None:
    rn.apply(kubectl, eager(PDB, 2))
    try:
        pods = wait_for("two Ready pods", lambda: ready_pods(kubectl, PDB, 2), timeout=300)
        assert {p["spec"]["nodeName"] for p in pods} == {NODE_NAME}
        wait_for(
            "the budget to allow one disruption",
            lambda: disruptions_allowed(kubectl) == 1,
            timeout=60,
        )  # fmt: skip
        start = time.monotonic()
        try:
            drain = kubectl("drain", NODE_NAME, f"--pod-selector=app.kubernetes.io/instance={PDB}",
                            "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=30s",
                            check=False, timeout=120)  # fmt: skip
            drain_s = time.monotonic() - start
            said = drain.stdout + drain.stderr
            # one pod went; the other was refused for the whole timeout: its replacement cannot
            # schedule on the cordoned node, so the budget never allows a second disruption
            assert drain.returncode != 0 and BUDGET_VIOLATION in said, said
            assert kubectl.json("node", NODE_NAME)["spec"].get("unschedulable") is True
            names = {p["metadata"]["name"] for p in pods}
            left = rn.runtime_pods(kubectl, PDB)
            kept = [p for p in left if p["metadata"]["name"] in names]
            assert len(kept) == 1 and rn.pod_ready(kept[0]), [p["metadata"]["name"] for p in left]
            assert disruptions_allowed(kubectl) == 0
            # the Eviction API itself answers 429 for the last Ready pod
            name = kept[0]["metadata"]["name"]
            eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                        "metadata": {"name": name, "namespace": rn.NAMESPACE}}  # fmt: skip
            refused = kubectl("create", "--raw",
                              f"/api/v1/namespaces/{rn.NAMESPACE}/pods/{name}/eviction", "-f", "-",
                              input=json.dumps(eviction), check=False)  # fmt: skip
            assert refused.returncode != 0, refused.stdout
            assert "TooManyRequests" in refused.stderr and BUDGET_VIOLATION in refused.stderr
            assert rn.pod_ready(kubectl.json("pod", name, "-n", rn.NAMESPACE))
        finally:
            kubectl("uncordon", NODE_NAME)
        # uncordoned: the replacement schedules, and the budget allows one disruption again
        wait_for("two Ready pods again", lambda: ready_pods(kubectl, PDB, 2), timeout=300)
        wait_for("the budget to recover", lambda: disruptions_allowed(kubectl) == 1, timeout=60)
        wait_for(
            "the AtomDeployment Ready",
            lambda: is_ready(rn.atomd(kubectl, PDB)),
            timeout=60,
        )
        print(f"\ndrain refused after {drain_s:.0f}s; recovered {time.monotonic() - start:.0f}s "
              "after the drain began")  # fmt: skip
    finally:
        kubectl("delete", "atomd", PDB, "-n", rn.NAMESPACE, "--wait=false", check=False)
