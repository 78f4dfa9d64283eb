"""Objects the launcher creates: fake GPU nodes for kwok and a default StorageClass."""

from __future__ import annotations

from pathlib import Path

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
STORAGE_CLASS = "kwok-volume"  # the name kwok's volume stages act on

NODE_CAPACITY = {"cpu": "64", "memory": "512Gi", "nvidia.com/gpu": "8", "pods": "110"}


def node(name: str, index: int) -> dict:
    """A node kwok manages (annotation) that looks like an 8-GPU machine; untainted so that
    any pod can land on it."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "status": {
            "capacity": dict(NODE_CAPACITY),
            "allocatable": dict(NODE_CAPACITY),
            "addresses": [
                {"type": "InternalIP", "address": f"10.1.0.{index + 1}"},
                {"type": "Hostname", "address": name},
            ],
            "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux"},
        },
    }


def storage_class() -> dict:
    """Default class: PVCs without a class get it and kwok's volume stages bind them."""
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": "kwok.x-k8s.io/volume",
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def kwok_config(stages_dir: Path) -> str:
    """kwok's --config: the Stage documents (the bare binary ships none)."""
    docs = [p.read_text().strip() for p in sorted(stages_dir.glob("*.yaml"))]
    return "\n---\n".join(docs) + "\n"
