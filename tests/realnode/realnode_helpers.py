"""Helpers of the real-node tests: polling with a deadline, JSON over HTTP to pod IPs, the
AtomDeployments and runtime pods of a namespace."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from atom_devtools.kubectl import Kubectl

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "realnode"
EXAMPLE = yaml.safe_load((ROOT / "examples" / "atomdeployment-cpu.yaml").read_text())


def http_json(url: str, timeout: float = 5) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except ValueError:
            return err.code, body.decode(errors="replace")
    except OSError as err:
        return 0, str(err)


def apply(kubectl: Kubectl, manifest: dict[str, Any]) -> None:
    kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(manifest))


def atomd(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return kubectl.json("atomd", name, "-n", NAMESPACE)


def runtime_pods(kubectl: Kubectl, name: str, role: str = "unified") -> list[dict]:
    """The role's pods that are not being deleted."""
    selector = f"app.kubernetes.io/instance={name},atom.dev/role={role}"
    pods = kubectl.json("pods", "-n", NAMESPACE, "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod["status"].get("conditions", []))  # fmt: skip


def ready_pods(kubectl: Kubectl, name: str, count: int) -> list[dict[str, Any]]:
    """The role's pods when there are `count` and all are Ready, else []."""
    pods = runtime_pods(kubectl, name)
    return pods if len(pods) == count and all(map(pod_ready, pods)) else []


def status_of(pod: dict[str, Any]) -> dict[str, Any]:
    code, body = http_json(f"http://{pod['status']['podIP']}:8000/status")
    assert code == 200, body
    return body


def running_real_cluster(images: dict[str, Any], **options: bool) -> Iterator[Any]:
    """A LocalCluster(real_node=True, **options) with `images` imported, for a fixture to yield
    from; stopped after, and the host must be left clean (no leftover, no process)."""
    import pytest

    from atom_devtools.devcluster import ClusterError, LocalCluster, ProvisionError
    from atom_devtools.devcluster.realnode import leftovers

    cluster = LocalCluster(real_node=True, **options)
    try:
        cluster.start()
        for image in images.values():
            cluster.node.import_image(image.layout, image.ref)
    except (ProvisionError, ClusterError) as exc:
        cluster.stop()
        pytest.fail(str(exc), pytrace=False)
    node_dir = cluster.dir
    pids = [p.popen.pid for p in cluster.procs if p.popen is not None]
    yield cluster
    cluster.stop()
    left = leftovers(node_dir)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not left and not alive, f"the real node left {left}, processes {alive}"


def chart_operator(cluster: Any, images: dict[str, Any]) -> Kubectl:
    """kubectl on a real-node cluster of a module's own, once the operator is installed there
    by its chart (as a real pod) and NAMESPACE exists."""
    from atom_devtools.demo_real import helm_install

    kubectl = Kubectl(cluster.env())
    helm_install(kubectl, images, timeout=300)
    kubectl("create", "namespace", NAMESPACE, check=False)
    return kubectl
