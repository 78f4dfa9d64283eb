"""Workloads on the fake GPU nodes: scheduling, readiness, GPU accounting, volumes, Jobs."""

from __future__ import annotations

import ipaddress

from testutil import wait_for

from .kube import apply, get_json


def _deployment(name: str, namespace: str, replicas: int, gpus: int) -> dict:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{
                    "name": "main",
                    "image": "registry.invalid/never-pulled:1",  # kwok runs no containers
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }]},
            },
        },
    }


def _ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


def test_deployment_pods_are_scheduled_on_kwok_nodes_and_become_ready(cluster, namespace):
    apply(cluster, _deployment("web", namespace, replicas=3, gpus=2))

    def ready_pods():
        pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=web")["items"]
        return pods if len(pods) == 3 and all(map(_ready, pods)) else None

    pods = wait_for("3 Ready pods of the Deployment", ready_pods)
    for pod in pods:
        assert pod["spec"]["nodeName"] in cluster.node_names
        assert pod["status"]["phase"] == "Running"
        assert ipaddress.ip_address(pod["status"]["podIP"]) in ipaddress.ip_network("10.244.0.0/16")
    wait_for(
        "the Deployment to report 3 ready replicas",
        lambda: get_json(cluster, "deployment", "web", "-n", namespace)["status"].get(
            "readyReplicas"
        ) == 3,
    )


def test_scheduler_counts_gpus(cluster, namespace):
    # Each fake node has 8 GPUs: a pod asking for 9 can never be placed.
    apply(cluster, _deployment("greedy", namespace, replicas=1, gpus=9))

    def unschedulable():
        pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=greedy")["items"]
        conds = [c for p in pods for c in p.get("status", {}).get("conditions", [])]
        return [c for c in conds if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"]

    cond = wait_for("the 9-GPU pod to be reported Unschedulable", unschedulable)
    assert "nvidia.com/gpu" in cond[0]["message"]
    pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=greedy")["items"]
    assert all(not p["spec"].get("nodeName") for p in pods)


def test_claim_without_class_is_bound_and_mountable(cluster, namespace):
    apply(cluster, {
        "apiVersion": "v1", "kind": "PersistentVolumeClaim",
        "metadata": {"name": "cache", "namespace": namespace},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    })
    pvc = wait_for(
        "the claim to be Bound",
        lambda: (lambda c: c if c["status"].get("phase") == "Bound" else None)(
            get_json(cluster, "pvc", "cache", "-n", namespace)
        ),
    )
    assert pvc["spec"]["storageClassName"] == "kwok-volume"  # the default class was applied
    apply(cluster, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "user", "namespace": namespace},
        "spec": {
            "containers": [{"name": "main", "image": "registry.invalid/x:1",
                            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}],
            "volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}}],
        },
    })
    wait_for(
        "the pod using the claim to be Ready",
        lambda: _ready(get_json(cluster, "pod", "user", "-n", namespace)),
    )


def test_job_pods_complete(cluster, namespace):
    apply(cluster, {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": "warmup", "namespace": namespace},
        "spec": {"template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "main", "image": "registry.invalid/x:1"}],
        }}},
    })
    wait_for(
        "the Job to succeed",
        lambda: get_json(cluster, "job", "warmup", "-n", namespace)["status"].get(
            "succeeded"
        ) == 1,
    )
