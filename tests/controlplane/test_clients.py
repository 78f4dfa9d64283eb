"""kubectl and helm (the cached binaries) talk to the local cluster."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from atom_devtools.devcluster import cache, versions

from .kube import get_json


def test_kubectl_reports_pinned_client_and_server_versions(cluster):
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert out["clientVersion"]["gitVersion"] == versions.KUBERNETES
    assert out["serverVersion"]["gitVersion"] == versions.KUBERNETES


def test_kubectl_lists_the_fake_gpu_nodes(cluster):
    nodes = get_json(cluster, "nodes")["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == sorted(cluster.node_names)
    for node in nodes:
        capacity = node["status"]["capacity"]
        assert capacity["nvidia.com/gpu"] == "8"
        assert capacity["cpu"] == "64"
        assert capacity["memory"] == "512Gi"
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"


def _helm(cluster, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = cluster.env() | {  # keep helm's state out of the home directory
        "HELM_CACHE_HOME": str(tmp_path / "helm-cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "helm-config"),
        "HELM_DATA_HOME": str(tmp_path / "helm-data"),
    }
    return subprocess.run([str(cache.HELM.path()), *args], capture_output=True, text=True,
                          env=env, timeout=120, check=True)


def test_helm_version_and_release_against_the_cluster(cluster, namespace, tmp_path):
    assert _helm(cluster, tmp_path, "version", "--short").stdout.startswith(versions.HELM)

    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    _helm(cluster, tmp_path, "install", "probe", str(chart), "-n", namespace,
          "--set", "greeting=hello", "--wait", "--timeout", "60s")

    cm = get_json(cluster, "configmap", "probe-cm", "-n", namespace)
    assert cm["data"] == {"greeting": "hello"}
    releases = json.loads(_helm(cluster, tmp_path, "list", "-A", "-o", "json").stdout)
    assert {"name": "probe", "namespace": namespace, "status": "deployed"}.items() <= next(
        r for r in releases if r["name"] == "probe").items()
    _helm(cluster, tmp_path, "uninstall", "probe", "-n", namespace, "--wait")
    assert cluster.kubectl("get", "configmap", "probe-cm", "-n", namespace,
                           check=False).returncode != 0
