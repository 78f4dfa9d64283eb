"""GitOps on the real node: Flux (source-controller and kustomize-controller, host processes of
`LocalCluster(real_node=True, flux=True)`) follows a Git repository on 127.0.0.1 and applies an
AtomDeployment whose pods really run (SmolLM2 on the CPU, Inductor), the operator installed by
its chart. Device cpu runs no CUDA graphs (the CRD refuses any other mode), so the change
pushed and then reverted is the compilation level: 3 -> 2, `git revert` back to 3.

The reverted-to revision is the first one, hence the same compile-cache key on the same claim:
its pod loads what the first level-3 pod compiled (cache-hit counters from /status) and
compiles nothing. Push to Ready and revert to Ready are printed. This module brings its own
real node (Flux's controllers run with the cluster), so it runs before the session's one.

Run under the real-node lock: flock /tmp/atom-realnode.lock .venv/bin/pytest -s ... (-s prints
the numbers).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from realnode_helpers import (
    EXAMPLE,
    NAMESPACE,
    atomd,
    chart_operator,
    ready_pods,
    running_real_cluster,
    status_of,
)

from atom_devtools.devcluster.fluxrepo import FluxRepo, condition, revision_of
from atom_devtools.devcluster.gitserver import Checkout, GitServer
from atom_devtools.kubectl import Kubectl, is_ready
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.own_real_node, pytest.mark.slow]

NAME = "gitops-cpu"
FILE = f"models/{NAME}.yaml"
READY_TIMEOUT = 600


@pytest.fixture(scope="module")
def flux_cluster(real_images: dict[str, Any]) -> Iterator[Any]:
    # fails (with the install command) when the flux addon is not in the cache
    yield from running_real_cluster(real_images, flux=True)


@pytest.fixture(scope="module")
def kube_ctl(flux_cluster: Any, real_images: dict[str, Any]) -> Kubectl:
    return chart_operator(flux_cluster, real_images)


@pytest.fixture(scope="module")
def repo(kube_ctl: Kubectl, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FluxRepo]:
    """The GitRepository and Kustomization docs/gitops.md shows, on a repository of the local
    Git server (the Kustomization's healthCheckExprs wait for the AtomDeployment's rollout)."""
    from atom_devtools.demo_gitops import doc_flux_manifests

    source, models = doc_flux_manifests()
    name = source["metadata"]["name"]
    with GitServer() as server:
        url = server.create(name)
        checkout = Checkout(url, tmp_path_factory.mktemp("git") / name)
        checkout.commit({"README.md": "models on the real node\n"}, "empty platform")
        source["spec"]["url"] = url
        kube_ctl("apply", "-f", "-", input=yaml.safe_dump_all([source, models]))
        yield FluxRepo(kube_ctl, checkout, name)


def manifest(level: int) -> str:
    out = copy.deepcopy(EXAMPLE)
    out["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    # Inductor: its compiled pieces are what the claim keeps (FX graphs alone keep nothing)
    out["spec"]["compilation"] = {"level": level, "useInductor": True}
    return yaml.safe_dump(out, sort_keys=False)


def rolled_out(repo: FluxRepo, kubectl: Kubectl, push: Callable[[], str],
               level: int) -> dict[str, Any]:
    """Push a commit, then the Kustomization Ready at it (its health checks passed: the
    AtomDeployment Ready at the generation Flux applied) and the one pod serving at `level`;
    returns the AtomDeployment's revision, the pod's /status and the seconds from the push."""
    pushed = time.monotonic()
    sha = push()
    ks = repo.wait_done("models", sha, timeout=READY_TIMEOUT)
    took = time.monotonic() - pushed
    assert condition(ks, "Ready")["status"] == "True", json.dumps(ks["status"], indent=1)
    assert ks["status"]["lastAppliedRevision"] == revision_of(sha)
    obj = atomd(kubectl, NAME)
    assert is_ready(obj), json.dumps(obj["status"], indent=1)
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert obj["spec"]["compilation"]["level"] == level
    pod = wait_for(f"one Ready pod of {NAME}", lambda: ready_pods(kubectl, NAME, 1), timeout=60)[0]
    status = status_of(pod)
    assert status["level"] == level, status["level"]
    return {"revision": obj["status"]["revision"], "pod": status, "ready_s": took, "sha": sha}


def test_git_revert_rolls_back_and_starts_warm_from_the_claim(
    repo: FluxRepo, kube_ctl: Kubectl
) -> None:
    first = rolled_out(repo, kube_ctl, lambda: repo.push({FILE: manifest(3)}, "level 3"), 3)
    cold = first["pod"]["warmup"]["counters"]
    assert cold.get("cache_misses", 0) >= 1 and cold.get("artifacts_saved", 0) >= 1, cold

    second = rolled_out(repo, kube_ctl, lambda: repo.push({FILE: manifest(2)}, "level 2"), 2)
    assert second["revision"] != first["revision"]
    assert second["pod"]["cache_key"] != first["pod"]["cache_key"]  # the level is in the key

    back = rolled_out(repo, kube_ctl, lambda: repo.revert(second["sha"]), 3)
    # the first revision again, so the first pod's directory on the claim
    assert back["revision"] == first["revision"]
    assert back["pod"]["cache_key"] == first["pod"]["cache_key"]
    warm = back["pod"]["warmup"]["counters"]
    numbers = {
        "first_push_to_ready_s": round(first["ready_s"], 1),
        "push_to_ready_s": round(second["ready_s"], 1),
        "revert_to_ready_s": round(back["ready_s"], 1),
        "cold_compile_s": first["pod"]["warmup"]["compile_seconds"],
        "revert_compile_s": back["pod"]["warmup"]["compile_seconds"],
        "cold_counters": cold,
        "revert_counters": warm,
    }
    print("\ngitops revert on the real node:", json.dumps(numbers, indent=1))
    # every piece the first pod compiled comes from the claim; nothing is compiled again
    assert warm.get("cache_hits") == cold["cache_misses"], warm
    served = warm.get("artifacts_loaded", 0) + warm.get("artifacts_reused", 0)
    assert served == cold["artifacts_saved"], warm
    assert warm.get("artifacts_loaded", 0) >= 1, warm
    assert not warm.get("cache_misses") and not warm.get("pieces_compiled"), warm
    assert back["pod"]["warmup"]["compile_seconds"] < first["pod"]["warmup"]["compile_seconds"]
