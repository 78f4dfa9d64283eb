"""The chart on the local control plane (real kube-apiserver, kwok nodes).

Tests in this module run in order and share one release: install, then upgrade, then
uninstall. The operator image need not exist: kwok marks the pod Running and Ready without
pulling it, which is what `helm install --wait` and the Deployment status observe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartutil import CHART, ROOT, Runner

from testutil import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RELEASE = "atom-op"
NAMESPACE = "atom-chart-test"
USER_NAMESPACE = "atom-chart-user"
CRD = "atomdeployments.atom.dev"
DEPLOYMENT = RELEASE + "-atom-operator"
SA = f"system:serviceaccount:{NAMESPACE}:{DEPLOYMENT}"


def kubectl_json(run: Runner, *args: str) -> dict[str, Any]:
    return json.loads(run(["kubectl", *args, "-o", "json"]).stdout)


def exists(run: Runner, *args: str) -> bool:
    return run(["kubectl", "get", *args, "--ignore-not-found", "-o", "name"]).stdout.strip() != ""


def replica_sets(run: Runner) -> dict[str, dict[str, Any]]:
    items = kubectl_json(
        run, "get", "rs", "-n", NAMESPACE, "-l", "app.kubernetes.io/instance=" + RELEASE
    )["items"]
    return {rs["metadata"]["labels"]["pod-template-hash"]: rs for rs in items}


def deployment_ready(run: Runner) -> bool:
    dep = kubectl_json(run, "get", "deployment", DEPLOYMENT, "-n", NAMESPACE)
    status, want = dep.get("status", {}), dep["spec"]["replicas"]
    return (
        want == 2  # the chart's default: two replicas electing a leader
        and status.get("observedGeneration") == dep["metadata"]["generation"]
        and status.get("readyReplicas") == want
        and status.get("updatedReplicas") == want
        and status.get("replicas") == want
    )


def can_i(run: Runner, verb: str, resource: str, namespace: str | None = None) -> bool:
    args = ["kubectl", "auth", "can-i", verb, resource, "--as", SA]
    args += ["-n", namespace] if namespace else ["--all-namespaces"]
    return run(args, check=False).stdout.strip() == "yes"


@pytest.fixture(scope="module")
def crd_was_absent(run_cluster: Runner) -> bool:
    """Remove the CRD first when nothing depends on it, so install is seen creating it."""
    if exists(run_cluster, "crd", CRD):
        users = run_cluster(["kubectl", "get", "atomd", "-A", "-o", "name"]).stdout.strip()
        if users:
            return False  # other tests' objects live on it: keep them
        run_cluster(["kubectl", "delete", "crd", CRD, "--wait=true"])
    return True


@pytest.fixture(scope="module", autouse=True)
def namespaces(run_cluster: Runner):
    for ns in (NAMESPACE, USER_NAMESPACE):
        run_cluster(["kubectl", "create", "namespace", ns], check=False)
    yield
    run_cluster(["helm", "uninstall", RELEASE, "-n", NAMESPACE, "--wait"], check=False)
    run_cluster(
        ["kubectl", "delete", "atomd", "--all", "-n", USER_NAMESPACE, "--wait=false"], check=False
    )
    for ns in (NAMESPACE, USER_NAMESPACE):
        run_cluster(["kubectl", "delete", "namespace", ns, "--wait=false"], check=False)


def test_template_is_accepted_by_the_api_server(run_cluster: Runner) -> None:
    for values in ([], ["--set", "scope=namespaced"]):
        manifest = run_cluster(
            ["helm", "template", RELEASE, str(CHART), "-n", NAMESPACE, "--include-crds", *values]
        ).stdout
        result = run_cluster(
            ["kubectl", "apply", "--dry-run=server", "--server-side", "-n", NAMESPACE, "-f", "-"],
            input=manifest,
        )
        kinds = {doc["kind"] for doc in yaml.safe_load_all(manifest) if doc}
        assert {
            "Deployment",
            "ServiceAccount",
            "Service",
            "Pod",
            "CustomResourceDefinition",
        } <= kinds
        assert result.stdout.count("(server dry run)") == sum(
            1 for doc in yaml.safe_load_all(manifest) if doc
        ), result.stdout


def test_install_brings_the_operator_to_ready(run_cluster: Runner, crd_was_absent: bool) -> None:
    run_cluster(
        ["helm", "install", RELEASE, str(CHART), "-n", NAMESPACE, "--wait", "--timeout", "3m"],
        timeout=240,
    )
    assert deployment_ready(run_cluster)
    assert exists(run_cluster, "crd", CRD), "the chart's crds/ folder was not installed"
    crd = kubectl_json(run_cluster, "get", "crd", CRD)
    established = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert established.get("Established") == "True"
    if crd_was_absent:
        # Helm's crds/ folder is applied as is, outside the release: no release annotation.
        assert "meta.helm.sh/release-name" not in crd["metadata"].get("annotations", {})
    pods = kubectl_json(
        run_cluster, "get", "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/instance=" + RELEASE
    )["items"]
    assert len(pods) == 2  # two replicas electing a leader
    for pod in pods:
        ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
        assert ready["Ready"] == "True"
        assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    pdb = kubectl_json(run_cluster, "get", "pdb", DEPLOYMENT, "-n", NAMESPACE)
    assert pdb["spec"]["minAvailable"] == 1


def test_rbac_is_least_privilege(run_cluster: Runner) -> None:
    # What the operator needs, in any namespace (cluster scope) ...
    for verb, resource in [
        ("watch", "atomdeployments.atom.dev"),
        ("patch", "atomdeployments.atom.dev/status"),
        ("create", "deployments.apps"),
        ("delete", "services"),
        ("create", "persistentvolumeclaims"),
        ("create", "jobs.batch"),
        ("list", "pods"),
        ("create", "events"),
        ("create", "secrets"),
        ("delete", "networkpolicies.networking.k8s.io"),
        ("delete", "poddisruptionbudgets.policy"),
        ("list", "horizontalpodautoscalers.autoscaling"),
        ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
    ]:
        assert can_i(run_cluster, verb, resource), f"operator cannot {verb} {resource}"
    # the leader-election Lease, in the release namespace only
    assert can_i(run_cluster, "update", "leases.coordination.k8s.io", NAMESPACE)
    assert not can_i(run_cluster, "update", "leases.coordination.k8s.io", USER_NAMESPACE)
    # ... and nothing more.
    for verb, resource in [
        ("get", "secrets"),
        ("delete", "pods"),
        ("create", "atomdeployments.atom.dev"),
        ("delete", "atomdeployments.atom.dev"),
        ("create", "clusterroles.rbac.authorization.k8s.io"),
        ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ]:
        assert not can_i(run_cluster, verb, resource), f"operator may {verb} {resource}"


def test_host_volumes_refused_at_the_api_server(run_cluster: Runner) -> None:
    manifest = {
        "apiVersion": "atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "hosty", "namespace": USER_NAMESPACE},
        "spec": {"model": {"name": "m", "volume": {"hostPath": {"path": "/"}}}},
    }
    last = ""

    def refused() -> bool:  # the policy takes effect once the API server has loaded it
        nonlocal last
        proc = run_cluster(
            ["kubectl", "apply", "--dry-run=server", "-f", "-"],
            input=json.dumps(manifest),
            check=False,
        )
        last = proc.stderr
        return proc.returncode != 0

    wait_for("the host-volume policy to refuse", refused, timeout=60)
    assert "spec.model.volume.hostPath" in last, last
    manifest["spec"]["model"]["volume"] = {"persistentVolumeClaim": {"claimName": "weights"}}
    ok = run_cluster(
        ["kubectl", "apply", "--dry-run=server", "-f", "-"],
        input=json.dumps(manifest),
        check=False,
    )
    assert ok.returncode == 0, ok.stderr


def test_upgrade_with_changed_values_rolls_the_operator(run_cluster: Runner) -> None:
    before = replica_sets(run_cluster)
    assert len(before) == 1
    run_cluster(
        [
            "helm", "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "--reuse-values",
            "--set", "operator.logLevel=DEBUG", "--wait", "--timeout", "3m",
        ],
        timeout=240,
    )  # fmt: skip
    wait_for(
        "the upgraded operator to be ready",
        lambda: deployment_ready(run_cluster),
        timeout=120,
    )
    after = replica_sets(run_cluster)
    new_hashes = set(after) - set(before)
    assert len(new_hashes) == 1, f"no new ReplicaSet: {sorted(after)}"
    new_rs = after[new_hashes.pop()]
    env = {
        e["name"]: e.get("value")
        for e in new_rs["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["ATOM_OPERATOR_LOG_LEVEL"] == "DEBUG"
    assert new_rs["status"].get("readyReplicas") == 2
    old = after[next(iter(before))]
    assert old["spec"]["replicas"] == 0, "the old operator pods are gone once the new ones are up"
    history = run_cluster(["helm", "history", RELEASE, "-n", NAMESPACE, "-o", "json"]).stdout
    assert [r["revision"] for r in json.loads(history)] == [1, 2]


def test_bad_values_are_refused_on_upgrade(run_cluster: Runner, tmp_path: Path) -> None:
    values = tmp_path / "bad.yaml"
    values.write_text("operator:\n  logLevel: LOUD\n")
    result = run_cluster(
        ["helm", "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values)], check=False
    )
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert "logLevel" in result.stderr
    history = json.loads(
        run_cluster(["helm", "history", RELEASE, "-n", NAMESPACE, "-o", "json"]).stdout
    )
    assert len(history) == 2, "a refused upgrade must not create a release revision"


def test_uninstall_keeps_the_crd_and_user_objects(run_cluster: Runner) -> None:
    example = (ROOT / "examples" / "atomdeployment.yaml").read_text()
    run_cluster(["kubectl", "apply", "-n", USER_NAMESPACE, "-f", "-"], input=example)
    name = yaml.safe_load(example)["metadata"]["name"]
    run_cluster(
        ["helm", "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout", "2m"], timeout=180
    )
    for kind in ("deployment", "serviceaccount", "service"):
        assert not exists(
            run_cluster, kind, "-n", NAMESPACE, "-l", "app.kubernetes.io/instance=" + RELEASE
        )
    assert not exists(run_cluster, "clusterrole", DEPLOYMENT)
    assert not exists(run_cluster, "clusterrolebinding", DEPLOYMENT)
    assert exists(run_cluster, "crd", CRD)
    assert exists(run_cluster, "atomd", name, "-n", USER_NAMESPACE)


def test_namespaced_install_limits_rbac_to_watched_namespaces(run_cluster: Runner) -> None:
    run_cluster(
        [
            "helm", "install", RELEASE, str(CHART), "-n", NAMESPACE, "--set", "scope=namespaced",
            "--wait", "--timeout", "3m",
        ],
        timeout=240,
    )  # fmt: skip
    try:
        assert deployment_ready(run_cluster)
        assert can_i(run_cluster, "create", "deployments.apps", NAMESPACE)
        assert can_i(run_cluster, "patch", "atomdeployments.atom.dev/status", NAMESPACE)
        assert not can_i(run_cluster, "create", "deployments.apps", USER_NAMESPACE)
        assert not can_i(run_cluster, "list", "atomdeployments.atom.dev", USER_NAMESPACE)
        assert can_i(run_cluster, "list", "customresourcedefinitions.apiextensions.k8s.io")
    finally:
        run_cluster(["helm", "uninstall", RELEASE, "-n", NAMESPACE, "--wait"], timeout=180)
