"""The real-node session: images built with buildah, one LocalCluster(real_node=True), the
operator installed by its Helm chart as a real pod. Teardown must leave the host clean."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from realnode_helpers import NAMESPACE, running_real_cluster

from atom_devtools.kubectl import Kubectl


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The demo brings up its own real node, and one fits a machine: run it before any test
    # that starts the session's real cluster (which lives until the session ends).
    items.sort(key=lambda item: 0 if item.get_closest_marker("own_real_node") else 1)


@pytest.fixture(scope="session")
def real_images() -> dict[str, Any]:
    from atom_devtools import images
    from atom_devtools.devcluster import ProvisionError

    if os.geteuid() != 0:
        pytest.skip("the real node and buildah need root")
    start = time.monotonic()
    try:
        built = images.build()
    except ProvisionError as exc:
        pytest.fail(str(exc), pytrace=False)
    print(f"\nimages ready in {time.monotonic() - start:.0f}s: {[i.ref for i in built.values()]}")
    return built


@pytest.fixture(scope="session")
def real_cluster(real_images: dict[str, Any]) -> Iterator[Any]:
    yield from running_real_cluster(real_images)


@pytest.fixture(scope="session")
def kubectl(real_cluster: Any) -> Kubectl:
    return Kubectl(real_cluster.env())


@pytest.fixture(scope="session")
def operator_release(real_cluster: Any, kubectl: Kubectl, real_images: dict[str, Any]) -> str:
    from atom_devtools.demo_real import OPERATOR_NAMESPACE, helm_install

    start = time.monotonic()
    helm_install(kubectl, real_images, timeout=300)
    print(f"\nhelm install --wait: {time.monotonic() - start:.0f}s")
    kubectl("create", "namespace", NAMESPACE, check=False)
    return OPERATOR_NAMESPACE
