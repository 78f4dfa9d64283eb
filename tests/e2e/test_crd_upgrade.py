"""A CRD upgrade never strands existing objects (issue 49), on the real API server.

The previous release's CRD (tests/e2e/fixtures: the last one without the metadata.name rules)
accepts `7b-llama`; the current CRD refuses that name for new objects only (transition rules
with optionalOldSelf). After the upgrade the stored object can still be patched, the operator
still reconciles it, and its status says what to do about the name.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from atomd_e2e import Kubectl, OperatorProcess, atomd, condition, get, running_operator

from atom_devtools.devcluster.crds import wait_crd_established
from atom_devtools.kubectl import install_crd
from atom_operator.kube import Kube
from testutil import wait_for

NS, TIMEOUT = "atomd-upgrade", 90
PREVIOUS_CRD = Path(__file__).with_name("fixtures") / "atomdeployment-before-name-rules.yaml"
CRD_NAME = "atomdeployments.atom.dev"
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _spec(max_num_seqs: int = 16) -> dict[str, Any]:
    return {
        "model": {"name": "tiny-llama", "loadFormat": "dummy"},
        "engine": {"maxNumSeqs": max_num_seqs},
        "compileCache": {"enabled": False},
    }


@pytest.fixture(scope="module")
def upgraded(kubectl: Kubectl) -> Iterator[None]:
    """Objects created under the previous CRD, then the current CRD installed over it."""
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(PREVIOUS_CRD))
    wait_crd_established(kubectl, CRD_NAME)
    kubectl("create", "namespace", NS, check=False)
    try:
        # served by the previous CRD: created without a complaint
        kubectl.apply([atomd("7b-llama", NS, _spec()), atomd("llama-7b", NS, _spec())])
    finally:
        install_crd(kubectl)  # the current one, whatever happened: later modules need it
    yield
    kubectl("delete", "atomd", "--all", "-n", NS, "--wait=false", check=False)


@pytest.fixture(scope="module")
def operator(
    upgraded, kubectl: Kubectl, env: dict[str, str], tmp_path_factory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator")
    with running_operator(kubectl, env, log, NS, ATOM_OPERATOR_RECONCILE_INTERVAL="600") as op:
        yield op


def test_the_current_crd_refuses_the_name_for_new_objects(upgraded, kubectl) -> None:
    proc = kubectl.apply(atomd("7b-mistral", NS, _spec()), "--dry-run=server", check=False)
    assert proc.returncode != 0 and "metadata.name must be lowercase" in proc.stderr


def test_existing_objects_can_still_be_patched(upgraded, kubectl, kube: Kube) -> None:
    before = get(kube, NS, "7b-llama")["metadata"]["generation"]
    kubectl("patch", "atomd", "7b-llama", "-n", NS, "--type=merge", "-p",
            '{"spec":{"engine":{"maxNumSeqs":8}}}')  # fmt: skip
    kubectl.apply(atomd("7b-llama", NS, _spec(8)))  # a GitOps sync: server-side apply
    kubectl("label", "atomd", "7b-llama", "-n", NS, "team=serving")
    obj = get(kube, NS, "7b-llama")
    assert obj["metadata"]["generation"] == before + 1
    assert obj["spec"]["engine"]["maxNumSeqs"] == 8


def test_the_operator_reconciles_them_and_says_what_to_do(operator, kubectl, kube) -> None:
    def reconciled(name: str) -> dict[str, Any] | None:
        obj = get(kube, NS, name)
        observed = (obj.get("status") or {}).get("observedGeneration")
        return obj if observed == obj["metadata"]["generation"] else None

    obj = wait_for("7b-llama reconciled", lambda: reconciled("7b-llama"), timeout=TIMEOUT)
    ready = condition(obj, "Ready")["message"]
    assert "'atom-7b-llama'" in ready and "delete this one" in ready, ready
    assert kube.get("Deployment", NS, "7b-llama-unified") is not None
    if kube.get("Service", NS, "7b-llama") is None:  # Service names held to DNS-1035
        assert condition(obj, "Degraded")["reason"] == "InvalidName", obj["status"]
    ok = wait_for("llama-7b reconciled", lambda: reconciled("llama-7b"), timeout=TIMEOUT)
    assert condition(ok, "Degraded").get("reason") != "InvalidName"
    # and it keeps reconciling it: a patch is observed
    kubectl("patch", "atomd", "7b-llama", "-n", NS, "--type=merge", "-p",
            '{"spec":{"engine":{"maxNumSeqs":4}}}')  # fmt: skip
    wait_for("the patch observed", lambda: reconciled("7b-llama"), timeout=TIMEOUT)
