"""Where provisioned binaries live, and the stamps that make a second install a no-op."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from . import versions

STAMP = ".installed.json"


def cache_dir() -> Path:
    """$ATOM_CACHE_DIR, else ~/.cache/atom (outside the repository, shared by clones)."""
    env = os.environ.get("ATOM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "atom"


@dataclass(frozen=True)
class Component:
    name: str
    version: str
    binaries: tuple[str, ...]

    @property
    def bin_dir(self) -> Path:
        return cache_dir() / "bin" / f"{self.name}-{self.version}"

    @property
    def build_dir(self) -> Path:
        return cache_dir() / "build" / f"{self.name}-{self.version}"

    def path(self, binary: str | None = None) -> Path:
        return self.bin_dir / (binary or self.binaries[0])

    def is_installed(self) -> bool:
        """True when the stamp matches the version and every binary is present unchanged."""
        try:
            stamp = json.loads((self.bin_dir / STAMP).read_text())
        except (OSError, ValueError):
            return False
        if stamp.get("version") != self.version:
            return False
        sizes = stamp.get("binaries", {})
        for name in self.binaries:
            path = self.path(name)
            usable = path.is_file() if name.endswith(".tar") else os.access(path, os.X_OK)
            if not usable or sizes.get(name) != path.stat().st_size:
                return False
        return True

    def write_stamp(self, reported: dict[str, str]) -> None:
        stamp = {
            "version": self.version,
            "binaries": {name: self.path(name).stat().st_size for name in self.binaries},
            "reported": reported,
        }
        (self.bin_dir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")


ETCD = Component("etcd", versions.ETCD, ("etcd",))
KUBERNETES = Component(
    "kubernetes",
    versions.KUBERNETES,
    ("kube-apiserver", "kube-controller-manager", "kube-scheduler"),
)
KUBECTL = Component("kubectl", versions.KUBERNETES, ("kubectl",))
KWOK = Component("kwok", versions.KWOK, ("kwok",))
HELM = Component("helm", versions.HELM, ("helm",))

COMPONENTS: dict[str, Component] = {
    c.name: c for c in (ETCD, KUBERNETES, KUBECTL, KWOK, HELM)
}


def kwok_stages_dir() -> Path:
    """The kwok Stage manifests copied from the kwok module (the bare binary has none)."""
    return KWOK.bin_dir / "stages"


def bin_path() -> list[Path]:
    """Every component's bin directory, for PATH."""
    return [c.bin_dir for c in COMPONENTS.values()]


def missing() -> list[str]:
    return [name for name, c in COMPONENTS.items() if not c.is_installed()]


# The real node's pieces (installed by `hack/controlplane install`, checked only when a cluster
# with real_node=True starts): kubelet and kube-proxy from the same Kubernetes module.
KUBE_NODE = Component("kube-node", versions.KUBERNETES, ("kubelet", "kube-proxy"))
CONTAINERD = Component("containerd", versions.CONTAINERD,
                       ("containerd", "containerd-shim-runc-v2", "ctr"))
COREDNS = Component("coredns", versions.COREDNS, ("coredns",))
# `pause` is the static binary; pause.tar the OCI archive of localhost/atom-pause:<tag>.
PAUSE = Component("pause", versions.PAUSE, ("pause", "pause.tar"))

NODE_COMPONENTS: dict[str, Component] = {
    c.name: c for c in (KUBE_NODE, CONTAINERD, COREDNS, PAUSE)
}


def node_bin_path() -> list[Path]:
    return [c.bin_dir for c in NODE_COMPONENTS.values()]


def node_missing() -> list[str]:
    return [name for name, c in NODE_COMPONENTS.items() if not c.is_installed()]


@dataclass(frozen=True)
class VenvComponent(Component):
    """A Python tool in a virtualenv of its own, tools/<name>-<version>: its dependency pins
    stay out of the project's .venv. `python` among the binaries catches a venv whose base
    interpreter went away or changed."""

    @property
    def venv_dir(self) -> Path:
        return cache_dir() / "tools" / f"{self.name}-{self.version}"

    @property
    def bin_dir(self) -> Path:
        return self.venv_dir / "bin"


# The linters of tests/lint (installed by `hack/controlplane install`; the cluster needs neither).
KUBECONFORM = Component("kubeconform", versions.KUBECONFORM, ("kubeconform",))
CHECKOV = VenvComponent("checkov", versions.CHECKOV, ("checkov", "python"))

LINT_COMPONENTS: dict[str, Component] = {c.name: c for c in (KUBECONFORM, CHECKOV)}

ALL_COMPONENTS: dict[str, Component] = COMPONENTS | NODE_COMPONENTS | LINT_COMPONENTS
