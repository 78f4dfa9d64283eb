"""Flux on the local cluster: source-controller and kustomize-controller built from their Go
modules into the cache (an addon: addons.py), and run as host processes against the local API
server (`LocalCluster(flux=True)`, or `running(kubeconfig)` on a cluster already up).

Both controllers' go.mod files replace their `api` module with a local path, so `go install`
refuses them; a wrapper module requires both and repeats their other (versioned) replaces,
which a dependency's go.mod cannot impose. The CRDs come from the same module sources.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from . import cache, gotool, versions
from .api import probe_http
from .build import publish, write_wrapper
from .errors import ClusterError, ProvisionError
from .procs import Process, free_ports, stop_all

CONTROLLERS = {
    "source-controller": "github.com/fluxcd/source-controller",
    "kustomize-controller": "github.com/fluxcd/kustomize-controller",
}
FLUX = cache.Component("flux", versions.FLUX, tuple(CONTROLLERS))
NAMESPACE = "flux-system"
# A replace naming a module version (`old => new vX`); local-path replaces (`=> ./api`) name none.
# Dependency versions the module proxy here refuses (403), replaced by the nearest one it serves:
# source-controller v1.9.6 requires github.com/fluxcd/pkg/artifact v0.18.3.
PROXY_REPLACES = {"github.com/fluxcd/pkg/artifact": "v0.18.0"}
# As in the controllers' own Deployments, less leader election (one replica each).
COMMON_FLAGS = ("--watch-all-namespaces", "--log-level=debug", "--log-encoding=json",
                "--enable-leader-election=false")
_REPLACE = re.compile(r"^\s*(?:replace\s+)?(\S+)\s+=>\s+(\S+)\s+(v\S+)\s*$", re.M)


def crds_dir() -> Path:
    return FLUX.bin_dir / "crds"


# --- install ---------------------------------------------------------------------------------
def _versioned_replaces(gomod: str, where: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for old, new, version in _REPLACE.findall(gomod):
        if old != new:
            raise ProvisionError(f"{where} replaces {old} with another module ({new}): the "
                                 "wrapper only repeats same-module version replaces")
        out[old] = version
    return out


def install_flux(go: str) -> None:
    comp, version = FLUX, versions.FLUX
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    replaces: dict[str, str] = {}
    crds = wd / "crds"
    shutil.rmtree(crds, ignore_errors=True)
    crds.mkdir()
    for module in CONTROLLERS.values():
        info = json.loads(gotool.run([go, "mod", "download", "-json", f"{module}@{version}"],
                                     what=f"download of {module}@{version}", log=log, cwd=wd))
        for old, ver in _versioned_replaces(Path(info["GoMod"]).read_text(), module).items():
            if replaces.setdefault(old, ver) != ver:
                raise ProvisionError(f"the Flux controllers replace {old} with different "
                                     f"versions ({replaces[old]}, {ver})")
        bases = sorted((Path(info["Dir"]) / "config" / "crd" / "bases").glob("*.yaml"))
        if not bases:
            raise ProvisionError(f"no CRDs under config/crd/bases in {info['Dir']}")
        for src in bases:
            shutil.copyfile(src, crds / src.name)
    write_wrapper(wd, "atom.dev/fluxbuild", dict.fromkeys(CONTROLLERS.values(), version),
                  replaces | PROXY_REPLACES, CONTROLLERS.values())
    (wd / "go.sum").unlink(missing_ok=True)
    out = wd / "out"
    # -mod=mod, not `go mod tidy`: tidy also resolves the controllers' test-only imports
    # (gittestserver, helmtestserver, cosign's CLI), which the module proxy here does not serve.
    gotool.run([go, "build", "-mod=mod", "-ldflags", gotool.ldflags_x({}), "-o", f"{out}/",
                *CONTROLLERS.values()], what="build of the Flux controllers", log=log, cwd=wd)
    reported = {name: _check_module_version(go, out / name, module, version)
                for name, module in CONTROLLERS.items()}
    publish(comp, out, reported, {"crds": crds})


def _check_module_version(go: str, binary: Path, module: str, version: str) -> str:
    """The binary's embedded build info names the controller's module at the pinned version
    (the controllers have no --version flag)."""
    info = subprocess.run([go, "version", "-m", str(binary)], capture_output=True, text=True,
                          env=gotool.go_env()).stdout
    line = f"{module}\t{version}"
    if line not in info:
        raise ProvisionError(f"{binary.name} was not built from {module}@{version}:\n{info[-600:]}")
    return line.replace("\t", "@")


# --- run -------------------------------------------------------------------------------------
@dataclass
class Flux:
    """Both controllers against one API server, as host processes; `stop()` ends them and
    removes their working directory (the artifact storage and clones' temp files)."""

    kubeconfig: str
    workdir: Path
    timeout: float = 60
    procs: list[Process] = field(default_factory=list)

    def start(self) -> None:
        if not FLUX.is_installed():
            raise ProvisionError(f"the Flux controllers are not in {FLUX.bin_dir}: run "
                                 "`hack/controlplane install --addons flux`")
        self._kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crds_dir()))
        self._kubectl("create", "namespace", NAMESPACE, check=False)
        self._kubectl("wait", "--for=condition=Established", "--timeout=60s", "-f",
                      str(crds_dir()))

        storage, *ports = free_ports(5)
        tmp = self.workdir / "tmp"
        for folder in (tmp, self.workdir / "storage"):  # the controllers do not create them
            folder.mkdir(parents=True, exist_ok=True)
        # TMPDIR: the controllers clone and unpack under it; it goes with the workdir.
        env = dict(os.environ, KUBECONFIG=self.kubeconfig, RUNTIME_NAMESPACE=NAMESPACE,
                   TMPDIR=str(tmp))
        own = {
            "source-controller": [f"--storage-path={self.workdir / 'storage'}",
                                  f"--storage-addr=127.0.0.1:{storage}",
                                  f"--storage-adv-addr=127.0.0.1:{storage}"],
            "kustomize-controller": ["--no-remote-bases=true"],
        }
        ready = []
        for i, (name, flags) in enumerate(own.items()):
            metrics, healthz = ports[2 * i], ports[2 * i + 1]
            argv = [str(FLUX.path(name)), *COMMON_FLAGS, *flags,
                    f"--metrics-addr=127.0.0.1:{metrics}", f"--health-addr=127.0.0.1:{healthz}"]
            proc = Process(name, argv, self.log(name), env=env)
            proc.start()
            self.procs.append(proc)
            ready.append((name, f"http://127.0.0.1:{healthz}/readyz"))
        for name, url in ready:
            self._wait(f"{name} /readyz", functools.partial(probe_http, url))

    def stop(self) -> None:
        procs, self.procs = self.procs, []
        stop_all(procs)
        shutil.rmtree(self.workdir / "tmp", ignore_errors=True)
        shutil.rmtree(self.workdir / "storage", ignore_errors=True)

    def log(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def _kubectl(self, *args: str, check: bool = True) -> None:
        proc = subprocess.run([str(cache.KUBECTL.path()), "--kubeconfig", self.kubeconfig, *args],
                              capture_output=True, text=True, timeout=120)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed: {proc.stderr.strip()}")

    def _wait(self, what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.timeout
        while not done():
            for proc in self.procs:
                if not proc.alive:
                    raise ClusterError(f"{proc.describe_exit()}\n(while waiting for {what})")
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {self.timeout:.0f}s waiting for {what}\n"
                                   + "\n\n".join(p.describe_exit() for p in self.procs))
            time.sleep(0.2)


@contextlib.contextmanager
def running(kubeconfig: str) -> Iterator[Flux]:
    """Flux on a cluster that is already up (its kubeconfig), stopped (its directory removed) on
    exit; the CRDs stay, like any CRD the cluster holds."""
    flux = Flux(kubeconfig, Path(tempfile.mkdtemp(prefix="atom-flux-")))
    try:
        flux.start()
        yield flux
    finally:
        flux.stop()
        shutil.rmtree(flux.workdir, ignore_errors=True)
