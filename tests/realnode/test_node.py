"""The real node itself, and the operator installed by its chart running on it as a real pod."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from atom_devtools.demo_real import RELEASE
from atom_devtools.devcluster.realnode import NODE_NAME, TAINT_KEY
from atom_devtools.kubectl import Kubectl
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.slow]

TOLERATE = [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}]


def test_one_tainted_real_node_beside_the_kwok_nodes(real_cluster: Any, kubectl: Kubectl) -> None:
    nodes = {n["metadata"]["name"]: n for n in kubectl.json("nodes")["items"]}
    assert set(real_cluster.node_names) | {NODE_NAME} == set(nodes)
    real = nodes[NODE_NAME]
    assert {"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"} in real["spec"]["taints"]
    assert real["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://2.")
    for name in real_cluster.node_names:  # the fake GPU nodes stay for the scale tests
        assert nodes[name]["status"]["capacity"]["nvidia.com/gpu"] == "8"


def test_pods_reach_the_api_server_and_cluster_dns(
    real_cluster: Any, kubectl: Kubectl, real_images: dict[str, Any]
) -> None:
    script = (
        "import json, socket, ssl, urllib.request\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
        "req = urllib.request.Request('https://kubernetes.default.svc/version',\n"
        "    headers={'Authorization': 'Bearer ' + open(sa + '/token').read()})\n"
        "version = json.load(urllib.request.urlopen(req, context=ctx, timeout=10))\n"
        "print(json.dumps({'dns': socket.gethostbyname('kube-dns.kube-system.svc.cluster.local'),\n"
        "    'api': socket.gethostbyname('kubernetes.default.svc.cluster.local'),\n"
        "    'version': version['gitVersion']}))\n"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "reach", "namespace": "default"},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": {"type": "real"},
            "tolerations": TOLERATE,
            "containers": [{"name": "reach", "image": real_images["operator"].ref,
                            "command": ["python", "-c", script]}],
        },
    }  # fmt: skip
    kubectl("apply", "-f", "-", input=json.dumps(pod))
    try:
        phase = wait_for(
            "the pod to finish",
            lambda: kubectl.json("pod", "reach")["status"].get("phase") in ("Succeeded", "Failed")
            and kubectl.json("pod", "reach")["status"]["phase"],
            timeout=120,
        )  # fmt: skip
        logs = kubectl("logs", "reach").stdout
        assert phase == "Succeeded", logs
        answer = json.loads(logs.strip().splitlines()[-1])
        server = json.loads(kubectl("version", "-o", "json").stdout)["serverVersion"]
        assert answer == {"dns": "10.0.0.10", "api": "10.0.0.1", "version": server["gitVersion"]}
    finally:
        kubectl("delete", "pod", "reach", "--wait=false", check=False)


def test_operator_pod_runs_with_the_charts_rbac(operator_release: str, kubectl: Kubectl) -> None:
    selector = "app.kubernetes.io/name=atom-operator,app.kubernetes.io/component=operator"
    pods = kubectl.json("pods", "-n", operator_release, "-l", selector)["items"]
    assert len(pods) == 2  # the chart's default: two replicas, one leader (a Lease)
    for pod in pods:
        assert pod["spec"]["nodeName"] == NODE_NAME
        assert all(s["ready"] for s in pod["status"]["containerStatuses"])
        # It really watches: a namespace's AtomDeployment gets its children (see test_atomd),
        # and nothing in either log says the API server refused it.
        logs = kubectl("logs", "-n", operator_release, pod["metadata"]["name"]).stdout
        assert "forbidden" not in logs.lower(), logs[-3000:]


def test_helm_test_passes(operator_release: str, kubectl: Kubectl) -> None:
    result = subprocess.run(
        ["helm", "test", RELEASE, "-n", operator_release, "--timeout", "180s"],
        capture_output=True, text=True, env=kubectl.env, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # the test pod (deleted once it succeeded) called the operator's /healthz through its Service
    assert "Phase:          Succeeded" in result.stdout, result.stdout


def test_the_api_server_refuses_graph_modes_on_cpu(operator_release: str, kubectl: Kubectl) -> None:
    """The CRD's CEL rule, evaluated by the real API server (a server-side dry run)."""
    manifest = {
        "apiVersion": "atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "cpu-graphs", "namespace": "default"},
        "spec": {"device": "cpu", "model": {"name": "tiny-llama", "loadFormat": "dummy"},
                 "compilation": {"level": 3, "cudagraphMode": "TR_HYBRID"}},
    }  # fmt: skip
    refused = kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest),
                      check=False)  # fmt: skip
    assert refused.returncode != 0
    assert "device cpu runs no CUDA graphs" in refused.stderr, refused.stderr
    manifest["spec"]["compilation"]["cudagraphMode"] = "NONE"
    kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(manifest))
