"""Local Kubernetes control plane for tests and the demo (stdlib only: runs before install).

`install()` builds or fetches the pinned binaries into the cache; `LocalCluster` runs them.
"""

from __future__ import annotations

from .cache import cache_dir
from .errors import ClusterError, ProvisionError
from .provision import install, require

__all__ = ["ClusterError", "LocalCluster", "ProvisionError", "cache_dir", "install", "require"]


def __getattr__(name: str):  # LocalCluster imported lazily: `install` needs none of it
    if name == "LocalCluster":
        from .cluster import LocalCluster

        return LocalCluster
    raise AttributeError(name)
