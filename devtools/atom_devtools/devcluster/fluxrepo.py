"""A Git repository Flux follows on the local cluster: the GitRepository and Kustomization
objects, a commit pushed with Flux asked to fetch it at once (as `flux reconcile source git`
does), and the wait until the Kustomization has finished with that commit.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import ClusterError
from .flux import NAMESPACE
from .gitserver import BRANCH, Checkout

SOURCE_API = "source.toolkit.fluxcd.io/v1"
KUSTOMIZE_API = "kustomize.toolkit.fluxcd.io/v1"
REQUESTED_AT = "reconcile.fluxcd.io/requestedAt"


class Kubectl(Protocol):
    """LocalCluster.kubectl, or atom_devtools.kubectl.Kubectl."""

    def __call__(self, *args: str, input: str | None = ..., check: bool = ...,
                 timeout: float = ...) -> subprocess.CompletedProcess[str]: ...


def git_repository(name: str, url: str) -> dict[str, Any]:
    # A long interval: pushes ask for a fetch (push()), nothing waits for the poll.
    return {"apiVersion": SOURCE_API, "kind": "GitRepository",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"url": url, "interval": "10m", "ref": {"branch": BRANCH}}}


def kustomization(name: str, source: str, path: str, **spec: Any) -> dict[str, Any]:
    """A Kustomization of `path` in the GitRepository `source`; `spec` adds or overrides
    fields (wait, healthCheckExprs, targetNamespace, timeout...)."""
    return {"apiVersion": KUSTOMIZE_API, "kind": "Kustomization",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"interval": "10m", "path": path, "prune": True, "timeout": "2m",
                     "sourceRef": {"kind": "GitRepository", "name": source}, **spec}}


def condition(obj: Mapping[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c["type"] == kind), {})


def revision_of(sha: str) -> str:
    """How Flux names a commit of the branch (status.lastAppliedRevision)."""
    return f"{BRANCH}@sha1:{sha}"


@dataclass
class FluxRepo:
    """One repository on the Git server, its GitRepository (named like it) in flux-system,
    and a checkout to push from."""

    kubectl: Kubectl
    checkout: Checkout
    name: str

    def get(self, kind: str, name: str) -> dict[str, Any]:
        out = self.kubectl("get", kind, name, "-n", NAMESPACE, "-o", "json").stdout
        return dict(json.loads(out))

    def push(self, files: Mapping[str, str | None], message: str) -> str:
        """Commit (None deletes a file), push, ask Flux to fetch now; returns the SHA."""
        sha = self.checkout.commit(files, message)
        self.request(f"gitrepository/{self.name}")
        return sha

    def revert(self, sha: str) -> str:
        new = self.checkout.revert(sha)
        self.request(f"gitrepository/{self.name}")
        return new

    def request(self, ref: str) -> str:
        """Ask a Flux object to reconcile now (the annotation `flux reconcile` sets); returns
        the token it reports back in status.lastHandledReconcileAt."""
        token = f"{time.time_ns()}"
        self.kubectl("annotate", "--overwrite", "-n", NAMESPACE, ref, f"{REQUESTED_AT}={token}")
        return token

    def wait_done(self, ks: str, sha: str, timeout: float = 120) -> dict[str, Any]:
        """The Kustomization once it has finished an attempt at commit `sha`: applied and
        healthy (Ready=True) or failed (Ready=False); not while Ready is Unknown (Progressing)."""
        want = revision_of(sha)
        deadline = time.monotonic() + timeout
        obj: dict[str, Any] = {}
        while time.monotonic() < deadline:
            obj = self.get("kustomization", ks)
            status = obj.get("status") or {}
            ready = condition(obj, "Ready").get("status")
            if (status.get("lastAttemptedRevision") == want
                    and status.get("observedGeneration") == obj["metadata"]["generation"]
                    and ready in ("True", "False")):
                return obj
            time.sleep(0.5)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for Kustomization {ks} to "
                           f"finish {want}; status: {json.dumps(obj.get('status'), indent=1)}")

    def reconcile_again(self, ks: str, timeout: float = 60) -> dict[str, Any]:
        """Ask the Kustomization to reconcile once more and wait until it has (a no-op when
        nothing in Git or on the cluster changed)."""
        token = self.request(f"kustomization/{ks}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            obj = self.get("kustomization", ks)
            status = obj.get("status") or {}
            if (status.get("lastHandledReconcileAt") == token
                    and condition(obj, "Ready").get("status") in ("True", "False")):
                return obj
            time.sleep(0.5)
        raise ClusterError(f"Kustomization {ks} did not handle the reconcile request {token}")
