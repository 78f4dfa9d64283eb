"""Helpers every test tier shares. `wait_for` is the one poll of the suite: tests wait on
state they can observe (a condition, a count, an object), never on a sleep being long enough.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from atom_devtools.devcluster.cluster import LocalCluster

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], *, timeout: float = 60,
             interval: float = 0.5) -> T:
    """Poll `check` until it returns something truthy, and return that. An exception counts
    as not yet (API errors while things start); the deadline fails naming `what` and the last
    value or error."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = check()
        except Exception as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        time.sleep(interval)


async def async_wait_for(what: str, check: Callable[[], T], *, timeout: float = 10,
                         interval: float = 0.01) -> T:
    """wait_for inside an event loop: the loop keeps running between the checks."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval)


def started_cluster(*, addons: tuple[str, ...] = (), **options: bool) -> Iterator[LocalCluster]:
    """A started LocalCluster(**options) for a fixture to yield from, stopped after. Missing
    binaries or addons (built in the background by `hack/controlplane install --addons`, waited
    for here) fail the tests with the provisioning message: never a skip."""
    import pytest

    from atom_devtools.devcluster import ClusterError, LocalCluster, ProvisionError
    from atom_devtools.devcluster.addons import wait_installed

    try:
        for name in addons:
            wait_installed(name)
        local = LocalCluster(**options)
        local.start()
    except (ProvisionError, ClusterError) as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield local
    finally:
        local.stop()
