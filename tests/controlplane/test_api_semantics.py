"""The API server and controllers behave like a real cluster: CEL validation and garbage
collection."""

from __future__ import annotations

import uuid

from atom_devtools.devcluster.crds import wait_crd_established
from testutil import wait_for

from .kube import apply, get_json

RULE_MESSAGE = "replicas must not exceed maxReplicas"


def _crd(group: str) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"widgets.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [{
                "name": "v1", "served": True, "storage": True,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "properties": {"spec": {
                        "type": "object",
                        "properties": {"replicas": {"type": "integer"},
                                       "maxReplicas": {"type": "integer"}},
                        "x-kubernetes-validations": [{
                            "rule": "self.replicas <= self.maxReplicas",
                            "message": RULE_MESSAGE,
                        }],
                    }},
                }},
            }],
        },
    }


def test_cel_rule_refuses_invalid_object_with_its_message(cluster, namespace):
    group = f"g{uuid.uuid4().hex[:6]}.tests.atom.dev"
    apply(cluster, _crd(group))
    wait_crd_established(cluster.kubectl, f"widgets.{group}")

    def widget(name: str, replicas: int) -> dict:
        return {"apiVersion": f"{group}/v1", "kind": "Widget",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"replicas": replicas, "maxReplicas": 4}}

    # Discovery of a brand-new group can lag behind Established: retry the valid apply.
    wait_for(
        "the valid Widget to be accepted",
        lambda: apply(cluster, widget("ok", 4), check=False).returncode == 0,
        timeout=30,
    )
    refused = apply(cluster, widget("bad", 5), check=False)
    assert refused.returncode != 0
    assert RULE_MESSAGE in refused.stderr
    assert "Invalid" in refused.stderr
    names = [w["metadata"]["name"] for w in get_json(cluster, "widgets." + group, "-n",
                                                      namespace)["items"]]
    assert names == ["ok"]
    cluster.kubectl("delete", "crd", f"widgets.{group}", "--wait=false", check=False)


def test_deleting_owner_garbage_collects_dependents(cluster, namespace):
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "owner", "namespace": namespace}})
    uid = get_json(cluster, "configmap", "owner", "-n", namespace)["metadata"]["uid"]
    for name in ("dep-a", "dep-b"):
        apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
            "name": name, "namespace": namespace,
            "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                 "uid": uid}]}})
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "bystander", "namespace": namespace}})

    cluster.kubectl("delete", "configmap", "owner", "-n", namespace)

    def remaining():
        items = get_json(cluster, "configmaps", "-n", namespace)["items"]
        names = {i["metadata"]["name"] for i in items}
        return names if not names & {"dep-a", "dep-b"} else None

    names = wait_for("the dependents to be garbage-collected", remaining)
    assert "bystander" in names  # only the owned objects went


def test_deleting_deployment_removes_its_pods(cluster, namespace):
    labels = {"app": "gone"}
    apply(cluster, {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "gone", "namespace": namespace},
        "spec": {"replicas": 2, "selector": {"matchLabels": labels}, "template": {
            "metadata": {"labels": labels},
            "spec": {"containers": [{"name": "main", "image": "registry.invalid/x:1"}]}}},
    })
    wait_for(
        "2 pods",
        lambda: len(get_json(cluster, "pods", "-n", namespace, "-l", "app=gone")["items"]) == 2,
    )
    cluster.kubectl("delete", "deployment", "gone", "-n", namespace)
    wait_for(
        "the ReplicaSet and pods to be collected",
        lambda: not get_json(
            cluster, "pods,replicasets", "-n", namespace, "-l", "app=gone"
        )["items"],
    )
