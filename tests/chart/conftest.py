"""Fixtures for the chart tests: the helm binary and runners (offline, or on the cluster)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chartutil import Runner, find_helm, make_runner


@pytest.fixture(scope="session")
def helm_bin() -> str:
    found = find_helm()
    if found is None:
        pytest.skip("helm is not installed (run hack/controlplane install)")
    return found


@pytest.fixture(scope="session")
def run_offline() -> Runner:
    """Runs commands with no cluster: KUBECONFIG points nowhere so nothing can touch one."""
    env = dict(os.environ, KUBECONFIG=os.devnull, HELM_CACHE_HOME="/tmp/atom-helm-cache")
    return make_runner(env)


@pytest.fixture(scope="module")
def run_cluster(cluster, helm_bin: str) -> Runner:
    """Runs commands against the session's local cluster (kubectl and helm on PATH)."""
    env = dict(os.environ, **cluster.env())
    env["PATH"] = os.pathsep.join([str(Path(helm_bin).parent), env["PATH"]])
    # helm keeps its own caches and release-independent config under these; keep them private.
    for var, sub in (
        ("HELM_CACHE_HOME", "cache"),
        ("HELM_CONFIG_HOME", "config"),
        ("HELM_DATA_HOME", "data"),
    ):
        env[var] = str(Path(cluster.kubeconfig).parent / "helm" / sub)
    return make_runner(env)
