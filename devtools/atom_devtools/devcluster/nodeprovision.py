"""Provisioning of the real node's pieces: kubelet and kube-proxy (the Kubernetes wrapper
module), containerd 2 and CoreDNS (Go modules), a pause image of our own (no registry to pull
one from), and the Debian packages (runc, CNI plugins, iptables, buildah, umoci, skopeo,
mmdebstrap) installed with apt-get.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from . import cache, gotool, versions
from .build import build_kubernetes, check_version, publish
from .errors import ProvisionError

# The pause container: waits for SIGTERM/SIGINT and reaps the children it inherits as PID 1.
PAUSE_SOURCE = """package main

import (
\t"os"
\t"os/signal"
\t"syscall"
)

func main() {
\tsigs := make(chan os.Signal, 8)
\tsignal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
\tfor sig := range sigs {
\t\tif sig != syscall.SIGCHLD {
\t\t\treturn
\t\t}
\t\tfor {
\t\t\tvar status syscall.WaitStatus
\t\t\tif pid, _ := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 {
\t\t\t\tbreak
\t\t\t}
\t\t}
\t}
}
"""
PAUSE_IMAGE = f"localhost/atom-pause:{versions.PAUSE}"


def _staging(comp: cache.Component) -> Path:
    out = comp.build_dir / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def install_kube_node(go: str) -> None:
    build_kubernetes(go, cache.KUBE_NODE, cache.KUBE_NODE.binaries)


def _go_install(go: str, comp: cache.Component, packages: list[str], flags: dict[str, str]) -> Path:
    comp.build_dir.mkdir(parents=True, exist_ok=True)
    out = _staging(comp)
    gotool.run(
        [go, "install", "-ldflags", gotool.ldflags_x(flags), *packages],
        what=f"build of {comp.name}",
        log=comp.build_dir / "build.log",
        cwd=comp.build_dir,
        env=gotool.go_env() | {"GOBIN": str(out)},
    )
    return out


def install_containerd(go: str) -> None:
    comp, version = cache.CONTAINERD, versions.CONTAINERD
    mod = "github.com/containerd/containerd/v2"
    out = _go_install(
        go,
        comp,
        [f"{mod}/cmd/{b}@{version}" for b in comp.binaries],
        {f"{mod}/version.Version": version},
    )
    publish(comp, out, {"containerd": check_version(out / "containerd", ["--version"], version)})


def install_coredns(go: str) -> None:
    comp, version = cache.COREDNS, versions.COREDNS
    out = _go_install(go, comp, [f"github.com/coredns/coredns@{version}"], {})
    publish(
        comp, out, {"coredns": check_version(out / "coredns", ["-version"], version.lstrip("v"))}
    )


def _tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise ProvisionError(f"{name} not found: `hack/controlplane install debian` installs it")
    return path


def install_pause(go: str) -> None:
    """A static pause binary, and an OCI archive of an image holding only it (umoci, skopeo)."""
    comp = cache.PAUSE
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    src = wd / "src"
    src.mkdir(exist_ok=True)
    (src / "go.mod").write_text("module atom.dev/pause\n\ngo 1.26\n")
    (src / "main.go").write_text(PAUSE_SOURCE)
    out = _staging(comp)
    gotool.run(
        [go, "build", "-ldflags", gotool.ldflags_x({}), "-o", str(out / "pause"), "."],
        what="build of pause",
        log=log,
        cwd=src,
    )
    layout, bundle, tag = wd / "layout", wd / "bundle", versions.PAUSE
    shutil.rmtree(layout, ignore_errors=True)
    shutil.rmtree(bundle, ignore_errors=True)
    umoci, skopeo = _tool("umoci"), _tool("skopeo")
    image = f"{layout}:{tag}"
    steps = [
        [umoci, "init", "--layout", str(layout)],
        [umoci, "new", "--image", image],
        [umoci, "unpack", "--image", image, str(bundle)],
    ]
    for cmd in steps:
        gotool.run(cmd, what=f"umoci {cmd[1]}", log=log, cwd=wd, env=dict(os.environ))
    shutil.copy2(out / "pause", bundle / "rootfs" / "pause")
    for cmd in (
        [umoci, "repack", "--image", image, str(bundle)],
        [
            umoci,
            "config",
            "--image",
            image,
            "--config.entrypoint",
            "/pause",
            "--config.user",
            "65535:65535",
            "--architecture",
            "amd64",
            "--os",
            "linux",
        ],
        [skopeo, "copy", f"oci:{image}", f"oci-archive:{out / 'pause.tar'}:{PAUSE_IMAGE}"],
    ):
        gotool.run(cmd, what=f"{Path(cmd[0]).name} {cmd[1]}", log=log, cwd=wd, env=dict(os.environ))
    shutil.rmtree(bundle, ignore_errors=True)
    shutil.rmtree(layout, ignore_errors=True)
    publish(comp, out, {"pause": PAUSE_IMAGE})


# --- Debian packages ---------------------------------------------------------------------
def debian_missing() -> list[str]:
    """The pinned Debian packages not installed (all of them where dpkg is absent)."""
    if not shutil.which("dpkg-query"):
        return list(versions.DEBIAN_PACKAGES)
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *versions.DEBIAN_PACKAGES],
        capture_output=True,
        text=True,
    )
    installed = {
        line.split()[0]
        for line in proc.stdout.splitlines()
        if len(line.split()) > 1 and line.split()[1].startswith("ii")
    }
    return [p for p in versions.DEBIAN_PACKAGES if p not in installed]


def install_debian(_go: str = "") -> None:
    todo = debian_missing()
    if not todo:
        return
    if not shutil.which("apt-get"):
        raise ProvisionError(f"apt-get not found: the real node needs the Debian packages {todo}")
    if os.geteuid() != 0:
        raise ProvisionError(f"installing {todo} needs root (apt-get); run as root or with sudo")
    log = cache.cache_dir() / "build" / "debian.log"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    gotool.run(["apt-get", "update"], what="apt-get update", log=log, cwd=log.parent, env=env)
    gotool.run(
        ["apt-get", "install", "-y", "--no-install-recommends", *todo],
        what=f"apt-get install of {len(todo)} packages",
        log=log,
        cwd=log.parent,
        env=env,
    )
    left = debian_missing()
    if left:
        raise ProvisionError(f"apt-get did not install {left}; see {log}")
    print(f"  Debian packages installed: {' '.join(todo)}", file=sys.stderr, flush=True)


NODE_INSTALLERS: dict[str, Callable[[str], None]] = {
    "debian": install_debian,
    "kube-node": install_kube_node,
    "containerd": install_containerd,
    "coredns": install_coredns,
    "pause": install_pause,
}
