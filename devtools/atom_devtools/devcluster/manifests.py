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


def storage_class(default: bool = True) -> dict:
    """Default class (unless a real node's class is): kwok's volume stages bind its claims."""
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": STORAGE_CLASS,
            "annotations": {"storageclass.kubernetes.io/is-default-class": str(default).lower()},
        },
        "provisioner": "kwok.x-k8s.io/volume",
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }


def kwok_config(stages_dir: Path) -> str:
    """kwok's --config: the Stage documents (the bare binary ships none)."""
    docs = [p.read_text().strip() for p in sorted(stages_dir.glob("*.yaml"))]
    return "\n---\n".join(docs) + "\n"


def dns_service(cluster_ip: str) -> dict:
    """kube-dns without a selector: CoreDNS runs on the host, its EndpointSlice is written."""
    ports = [{"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
             {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53}]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "kube-dns", "namespace": "kube-system",
                     "labels": {"k8s-app": "kube-dns"}},
        "spec": {"clusterIP": cluster_ip, "ports": ports},
    }


def dns_endpoints(ip: str, port: int) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "kube-dns-host", "namespace": "kube-system",
                     "labels": {"kubernetes.io/service-name": "kube-dns",
                                "endpointslice.kubernetes.io/managed-by": "atom.dev-devcluster"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": True}}],
        "ports": [{"name": "dns", "port": port, "protocol": "UDP"},
                  {"name": "dns-tcp", "port": port, "protocol": "TCP"}],
    }


def local_path_class(name: str) -> dict:
    """The real node's class (default with a real node): claims become host directories."""
    return {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {
            "name": name,
            "annotations": {"storageclass.kubernetes.io/is-default-class": "true"},
        },
        "provisioner": "atom.dev/local-path",
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
    }
