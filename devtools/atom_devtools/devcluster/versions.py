"""Pinned versions of the control-plane binaries: the one place to change them."""

from __future__ import annotations

# Kubernetes: kube-apiserver, kube-controller-manager, kube-scheduler and kubectl share it.
KUBERNETES = "v1.36.3"
# The version the Kubernetes release pins in its go.mod (go.etcd.io/etcd/server/v3).
ETCD = "v3.6.8"
KWOK = "v0.8.0"
HELM = "v3.22.0"
# The linters tests/lint runs (not needed by the cluster): kubeconform from the Go module proxy,
# checkov from PyPI into its own virtualenv.
KUBECONFORM = "v0.8.0"
CHECKOV = "3.3.30"
# The real node (LocalCluster(real_node=True)): kubelet and kube-proxy come from KUBERNETES.
CONTAINERD = "v2.4.2"
COREDNS = "v1.15.0"
# The locally built pause image's tag (a small Go program of ours, no upstream pause image).
PAUSE = "3.10"
# Debian packages the real node and the image builds use (the suite's versions: bookworm).
DEBIAN_SUITE = "bookworm"
DEBIAN_PACKAGES = (
    "runc", "containernetworking-plugins", "iptables", "conntrack", "socat",
    "buildah", "umoci", "skopeo", "mmdebstrap", "uidmap",
)
# Optional components (`hack/controlplane install --addons`): KEDA (operator + metrics API
# server) and the Gateway API Inference Extension's InferencePool CRD.
KEDA = "v2.21.1"
# KEDA v2.21.1's go.mod says go 1.27.4: its go commands run under this toolchain (GOTOOLCHAIN).
KEDA_GO = "go1.27.4"
GATEWAY_API_INFERENCE_EXTENSION = "v1.6.2"
# Flux (the `flux` addon, devcluster/flux.py): source-controller and kustomize-controller of one
# release. v1.10.1 does not build here: its go.mod needs go 1.27 and the module proxy refuses 8
# of its dependencies' versions (403), so the previous minor's last patch.
FLUX = "v1.9.6"
# Oldest Go that builds all of the above (their go.mod files say go 1.26.0).
MIN_GO = (1, 26)


def kube_minor(version: str = KUBERNETES) -> tuple[str, str]:
    """("1", "36") for "v1.36.3"."""
    major, minor, *_ = version.lstrip("v").split(".")
    return major, minor


def staging_version(version: str = KUBERNETES) -> str:
    """The published k8s.io/<staging module> version of a Kubernetes release: v1.36.3 -> v0.36.3."""
    _, minor = kube_minor(version)
    patch = version.lstrip("v").split(".")[2]
    return f"v0.{minor}.{patch}"
