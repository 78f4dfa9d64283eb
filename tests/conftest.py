"""Shared fixtures: the session's local Kubernetes cluster, and the gpu marker's auto-skip."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from atom_devtools.devcluster.cluster import LocalCluster


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups set here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
        if "real_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.realnode)
        # Under xdist (hack/test: --dist loadgroup) a group runs on one worker, in collection
        # order: each module is one (its tests share module fixtures and build on each other),
        # and every test that starts or uses a real node is one, since one real node fits a
        # machine (the demo's own node first: tests/realnode/conftest.py).
        module = item.nodeid.split("::", 1)[0]
        group = "realnode" if item.get_closest_marker("realnode") else module
        item.add_marker(pytest.mark.xdist_group(group))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items:
        import torch  # only when a gpu test is collected: keeps collection light otherwise

        if not torch.cuda.is_available():
            for item in gpu_items:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    """One real control plane (etcd, apiserver, controller-manager, scheduler, kwok) per session.

    Missing binaries fail the tests with the provisioning message: never a skip.
    """
    from testutil import started_cluster

    yield from started_cluster()
