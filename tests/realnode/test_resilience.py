"""What the kubelet does with the operator's pods when the engine hangs on a real node: the
liveness probe the operator renders restarts the container. (The node drain held by the
PodDisruptionBudget, and the other faults, are test_faults_real.py's.)

Level 0 and no compile cache (nothing here depends on compile): the pod starts in seconds, so
the timings below are the probes' own.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
import realnode_helpers as rn
from faults_helpers import restarts

from atom_devtools.kubectl import Kubectl
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.slow]


def eager(name: str, replicas: int) -> dict[str, Any]:
    manifest = copy.deepcopy(rn.EXAMPLE)
    manifest["metadata"] = {"name": name, "namespace": rn.NAMESPACE}
    manifest["spec"]["compilation"] = {"level": 0}
    manifest["spec"]["compileCache"] = {"enabled": False}
    manifest["spec"]["replicas"] = replicas
    return manifest


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
            lambda: rn.ready_pods(kubectl, HANG, 1),
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

        # Three failed probes 10 s apart, then the kubelet stops the container (preStop; the
        # runtime kills its stopped core after 10 s) and starts it again in the same pod. What
        # is waited on is the pod's own state (restartCount, then Ready), not an Event's text:
        # Events are best effort and were missed under load.
        def restarted() -> dict[str, Any] | None:
            again = kubectl.json("pod", pod["metadata"]["name"], "-n", rn.NAMESPACE)
            return again if restarts(again) > before else None

        again = wait_for("the container to restart", restarted, timeout=300, interval=2)
        restarted_s = time.monotonic() - stopped
        assert again["metadata"]["uid"] == pod["metadata"]["uid"]  # the same pod, not a new one
        # the stopped container ended (its last state), and only the liveness probe ended it:
        # one restart, the pod never deleted
        last = again["status"]["containerStatuses"][0]["lastState"].get("terminated")
        assert last is not None, again["status"]["containerStatuses"]
        assert restarts(again) == before + 1, again["status"]["containerStatuses"]

        def ready_again() -> dict[str, Any] | None:
            again = kubectl.json("pod", pod["metadata"]["name"], "-n", rn.NAMESPACE)
            return again if rn.pod_ready(again) and restarts(again) > before else None

        again = wait_for("the pod to be Ready again", ready_again, timeout=300, interval=2)
        ready_s = time.monotonic() - stopped
        assert rn.http_json(f"{url}/livez")[0] == 200
        status = rn.status_of(again)
        assert status["state"] == "ready" and status["core_pid"], status
        print(f"\nhung core: /livez 503 after {livez_failed_s:.0f}s, restarted after "
              f"{restarted_s:.0f}s, Ready again after {ready_s:.0f}s")  # fmt: skip
    finally:
        kubectl("delete", "atomd", HANG, "-n", rn.NAMESPACE, "--wait=false", check=False)
