"""Fixtures shared by the operator e2e modules (a module may override `kubectl`)."""

from __future__ import annotations

import pytest
from atomd_e2e import Kubectl, env_with_path

from atom_operator.kube import Kube


@pytest.fixture(scope="module")
def env(cluster) -> dict[str, str]:
    return env_with_path(cluster.env())


@pytest.fixture(scope="module")
def kubectl(env) -> Kubectl:
    return Kubectl(env)


@pytest.fixture(scope="module")
def kube(cluster) -> Kube:
    return Kube.from_kubeconfig(str(cluster.kubeconfig))
