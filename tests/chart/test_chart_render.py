"""The chart without a cluster: lint, rendered objects, schema refusals, the CRD copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartutil import CHART, ROOT, Runner, kube_version

RELEASE = "atom"
NAMESPACE = "atom-system"


def render(run: Runner, helm: str, *args: str, crds: bool = False) -> list[dict[str, Any]]:
    cmd = [helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    cmd += ["--kube-version", kube_version(), *args]
    if crds:
        cmd.append("--include-crds")
    out = run(cmd).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def watch_roles(docs: list[dict[str, Any]], kind: str = "Role") -> list[dict[str, Any]]:
    """Roles (or RoleBindings) on watched namespaces, not the leader-election one."""
    return [
        d for d in by_kind(docs, kind) if not d["metadata"]["name"].endswith("-leader-election")
    ]


def test_leader_election_rbac_in_the_release_namespace(run_offline: Runner, helm_bin: str) -> None:
    for scope in ("cluster", "namespaced"):
        docs = render(run_offline, helm_bin, "--set", f"scope={scope}")
        (role,) = [r for r in by_kind(docs, "Role") if r not in watch_roles(docs)]
        assert role["metadata"]["namespace"] == NAMESPACE
        assert rules_of(role) == {
            ("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")
        }


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


def test_chart_crd_is_the_generated_crd() -> None:
    generated = ROOT / "crds" / "atomdeployment.yaml"
    copy = CHART / "crds" / "atomdeployment.yaml"
    assert copy.read_bytes() == generated.read_bytes(), (
        "charts/atom-operator/crds/atomdeployment.yaml is stale: "
        "cp crds/atomdeployment.yaml charts/atom-operator/crds/"
    )


@pytest.mark.parametrize(
    "values", [[], ["--set", "scope=namespaced"]], ids=["cluster", "namespaced"]
)
def test_helm_lint_is_clean(run_offline: Runner, helm_bin: str, values: list[str]) -> None:
    result = run_offline(
        [helm_bin, "lint", str(CHART), "--strict", "--kube-version", kube_version(), *values]
    )
    assert "0 chart(s) failed" in result.stdout
    assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


def test_operator_pod_is_locked_down(run_offline: Runner, helm_bin: str) -> None:
    docs = render(run_offline, helm_bin)
    (deployment,) = by_kind(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    # Two replicas electing a leader on a Lease, a budget that keeps one through a drain.
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()
    env = {e["name"]: e for e in operator_container(docs)["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["ATOM_OPERATOR_LEASE_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.namespace"
    )
    single = render(run_offline, helm_bin, "--set", "operator.replicas=1")
    assert not by_kind(single, "PodDisruptionBudget")
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    container = operator_container(docs)
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
    (port,) = [p for p in container["ports"] if p["name"] == "health"]
    assert (
        port["containerPort"] == 8080
        and port["name"] == container["livenessProbe"]["httpGet"]["port"]
    )
    assert set(container["resources"]) == {"requests", "limits"}
    assert pod["serviceAccountName"] == by_kind(docs, "ServiceAccount")[0]["metadata"]["name"]


def test_values_reach_the_operator_environment(run_offline: Runner, helm_bin: str) -> None:
    docs = render(
        run_offline,
        helm_bin,
        "--set", "operator.logLevel=DEBUG",
        "--set", "runtime.image.repository=registry.example.com/atom-runtime",
        "--set", "runtime.image.tag=1.2.3",
        "--set", "operator.image.tag=9.9.9",
        "--set", "operator.reconcileInterval=15",
        "--set", "operator.resources.limits.memory=1Gi",
    )  # fmt: skip
    container = operator_container(docs)
    env = env_of(container)
    assert env["ATOM_OPERATOR_LOG_LEVEL"] == "DEBUG"
    assert env["ATOM_OPERATOR_DEFAULT_IMAGE"] == "registry.example.com/atom-runtime:1.2.3"
    assert env["ATOM_OPERATOR_RECONCILE_INTERVAL"] == "15"
    assert env["ATOM_OPERATOR_NAMESPACES"] == ""  # cluster scope: all namespaces
    assert container["image"].endswith(":9.9.9")
    assert container["resources"]["limits"]["memory"] == "1Gi"


def test_image_tags_default_to_app_version(run_offline: Runner, helm_bin: str) -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    container = operator_container(render(run_offline, helm_bin))
    assert container["image"].endswith(f":{app_version}")
    assert env_of(container)["ATOM_OPERATOR_DEFAULT_IMAGE"].endswith(f":{app_version}")


def rules_of(doc: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in doc["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_cluster_scope_rbac(run_offline: Runner, helm_bin: str) -> None:
    docs = render(run_offline, helm_bin)
    (role,) = by_kind(docs, "ClusterRole")
    (binding,) = by_kind(docs, "ClusterRoleBinding")
    assert not watch_roles(docs) and not watch_roles(docs, "RoleBinding")
    rules = rules_of(role)
    assert ("atom.dev", "atomdeployments/status", "patch") in rules
    assert ("apps", "deployments", "create") in rules
    assert ("", "namespaces", "watch") in rules
    assert ("apiextensions.k8s.io", "customresourcedefinitions", "watch") in rules
    # Least privilege: the operator neither writes its users' specs wholesale nor reads
    # secrets: it creates the internal-token Secret once and never reads it back.
    assert [verb for _, resource, verb in rules if resource == "secrets"] == ["create"]
    assert ("autoscaling", "horizontalpodautoscalers", "list") in rules
    # spec.autoscaling / spec.inferencePool children: those two kinds of their groups only.
    assert ("keda.sh", "scaledobjects", "patch") in rules
    assert ("inference.networking.k8s.io", "inferencepools", "delete") in rules
    assert {r for g, r, _ in rules if g in ("keda.sh", "inference.networking.k8s.io")} == {
        "scaledobjects", "inferencepools"}
    for resource in ("networkpolicies", "poddisruptionbudgets"):
        assert any(r == resource and v == "delete" for _, r, v in rules), resource
    assert ("atom.dev", "atomdeployments", "update") not in rules
    assert not any("*" in item for rule in rules for item in rule)
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["namespace"] == NAMESPACE


def test_namespaced_scope_rbac(run_offline: Runner, helm_bin: str) -> None:
    docs = render(
        run_offline,
        helm_bin,
        "--set",
        "scope=namespaced",
        "--set",
        "watchNamespaces={team-a,team-b}",
    )
    roles = watch_roles(docs)
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    assert sorted(b["metadata"]["namespace"] for b in watch_roles(docs, "RoleBinding")) == [
        "team-a",
        "team-b",
    ]
    (cluster_role,) = by_kind(docs, "ClusterRole")
    # Cluster-wide only what Kopf's discovery reads: CRDs and namespace names.
    assert rules_of(cluster_role) == {
        (group, resource, verb)
        for group, resource in (
            ("apiextensions.k8s.io", "customresourcedefinitions"),
            ("", "namespaces"),
        )
        for verb in ("get", "list", "watch")
    }
    assert env_of(operator_container(docs))["ATOM_OPERATOR_NAMESPACES"] == "team-a,team-b"


def test_namespaced_scope_defaults_to_the_release_namespace(
    run_offline: Runner, helm_bin: str
) -> None:
    docs = render(run_offline, helm_bin, "--set", "scope=namespaced")
    assert [r["metadata"]["namespace"] for r in watch_roles(docs)] == [NAMESPACE]
    assert env_of(operator_container(docs))["ATOM_OPERATOR_NAMESPACES"] == NAMESPACE


def test_crd_ships_in_crds_folder(run_offline: Runner, helm_bin: str) -> None:
    without = render(run_offline, helm_bin)
    with_crds = render(run_offline, helm_bin, crds=True)
    assert not by_kind(without, "CustomResourceDefinition")  # not a template: never deleted
    (crd,) = by_kind(with_crds, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "atomdeployments.atom.dev"


def test_helm_test_hook(run_offline: Runner, helm_bin: str) -> None:
    docs = render(run_offline, helm_bin)
    hooks = [d for d in docs if d["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    (pod,) = hooks
    assert pod["kind"] == "Pod" and pod["spec"]["restartPolicy"] == "Never"
    (service,) = by_kind(docs, "Service")
    assert f"{service['metadata']['name']}.{NAMESPACE}.svc:8080/healthz" in str(pod["spec"])
    assert render(run_offline, helm_bin, "--set", "tests.enabled=false") != docs


def test_no_object_repeats_a_label_key(run_offline: Runner, helm_bin: str) -> None:
    """kubeconform -strict and kustomize refuse a mapping with a key given twice; yaml.safe_load
    keeps the last, so read the rendered text itself."""
    cmd = [helm_bin, "template", RELEASE, str(CHART), "-n", NAMESPACE]
    out = run_offline([*cmd, "--kube-version", kube_version()]).stdout
    for doc in out.split("\n---"):
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "labels:":
                continue
            indent = len(line) - len(line.lstrip()) + 2
            keys = []
            for nxt in lines[i + 1 :]:
                if len(nxt) - len(nxt.lstrip()) != indent or not nxt.strip():
                    break
                keys.append(nxt.split(":")[0].strip())
            assert len(keys) == len(set(keys)), f"duplicate label in:\n{doc[:400]}"


def test_host_volume_policy_on_by_default(run_offline: Runner, helm_bin: str) -> None:
    docs = render(run_offline, helm_bin)
    (policy,) = by_kind(docs, "ValidatingAdmissionPolicy")
    (binding,) = by_kind(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert env_of(operator_container(docs))["ATOM_OPERATOR_ALLOW_HOST_VOLUMES"] == "false"
    allowed = render(run_offline, helm_bin, "--set", "admission.allowHostVolumes=true")
    assert not by_kind(allowed, "ValidatingAdmissionPolicy")


BAD_VALUES = {
    "enum": ("operator:\n  logLevel: LOUD\n", "logLevel"),
    "typo": ("operatr:\n  logLevel: INFO\n", "operatr"),
    "type": ("operator:\n  reconcileInterval: soon\n", "reconcileInterval"),
    "scope": ("scope: everywhere\n", "scope"),
    "quantity": ("operator:\n  resources:\n    limits:\n      memory: lots\n", "memory"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_values_breaking_the_schema_are_refused(
    run_offline: Runner, helm_bin: str, tmp_path: Path, case: str
) -> None:
    text, field = BAD_VALUES[case]
    values = tmp_path / "bad.yaml"
    values.write_text(text)
    result = run_offline(
        [
            helm_bin,
            "template",
            RELEASE,
            str(CHART),
            "--kube-version",
            kube_version(),
            "-f",
            str(values),
        ],
        check=False,
    )
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert field in result.stderr, result.stderr


def test_watch_namespaces_need_namespaced_scope(run_offline: Runner, helm_bin: str) -> None:
    result = run_offline(
        [helm_bin, "template", RELEASE, str(CHART), "--kube-version", kube_version()]
        + ["--set", "watchNamespaces={team-a}"],
        check=False,
    )
    assert result.returncode != 0
    assert "watchNamespaces is only used with scope: namespaced" in result.stderr


def test_monitoring_is_opt_in(run_offline: Runner, helm_bin: str) -> None:
    docs = render(run_offline, helm_bin)
    assert not by_kind(docs, "PodMonitor")
    assert not [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]
    ports = {p["name"]: p["containerPort"] for p in operator_container(docs)["ports"]}
    assert ports["metrics"] == 8081
    on = render(
        run_offline,
        helm_bin,
        "--set", "monitoring.podMonitor.enabled=true",
        "--set", "monitoring.podMonitor.labels.release=kp",
        "--set", "monitoring.grafanaDashboard.enabled=true",
    )  # fmt: skip
    (mon,) = by_kind(on, "PodMonitor")
    assert mon["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert mon["metadata"]["labels"]["release"] == "kp"
    (dashboard,) = [
        d for d in by_kind(on, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")
    ]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["atom-runtime.json"])["uid"] == "atom-runtime"
