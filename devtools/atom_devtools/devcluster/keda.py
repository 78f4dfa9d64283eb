"""KEDA in the local cluster: its build (the operator and the metrics API server), its CRDs,
and the two host processes `LocalCluster(keda=True)` runs beside the control plane.

The build: KEDA's go.mod has a replace and an exclude (a dependency's are ignored), so a
wrapper module repeats them; v2.21.1 says `go 1.27.4`, so its go commands run under that
toolchain (GOTOOLCHAIN fetches it from the module proxy once). `go mod tidy` is not used: it
resolves every build tag, and a tools-only import of ginkgo needs a pprof version the proxy no
longer serves; `go get` of the two commands resolves what the build needs.

At run time the API server reaches the metrics API server through the aggregation layer: an
APIService for external.metrics.k8s.io, an ExternalName Service `localhost` (the API server
runs on this host), and a front-proxy client certificate so KEDA can trust the user the API
server forwards (requestheader flags). The operator and the metrics server talk gRPC over
mutual TLS with one CA this module generates.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import gotool, versions
from .build import publish
from .cache import Component
from .errors import ProvisionError
from .procs import Process

KEDA = Component("keda", versions.KEDA, ("keda", "keda-adapter"))
MODULE = "github.com/kedacore/keda/v2"
# binary name -> main package inside the module
COMMANDS = {"keda": "cmd/operator", "keda-adapter": "cmd/adapter"}
CRD_DIR = "config/crd/bases"
NAMESPACE = "keda"
METRICS_SERVICE = "keda-metrics-apiserver"
APISERVICE = "v1beta1.external.metrics.k8s.io"
# The CN the API server's front-proxy client certificate carries (requestheader-allowed-names).
PROXY_CN = "front-proxy-client"


def _go_env() -> dict[str, str]:
    return gotool.go_env() | {"GOTOOLCHAIN": versions.KEDA_GO}


def _directives(gomod: str) -> list[str]:
    """KEDA's own replace and exclude lines (one-line and block forms), for the wrapper."""
    out = re.findall(r"^((?:replace|exclude) [^(\n]+)$", gomod, re.M)
    for verb, body in re.findall(r"^(replace|exclude) \(\n(.*?)^\)", gomod, re.M | re.S):
        out += [f"{verb} {line.strip()}" for line in body.splitlines()
                if line.strip() and not line.strip().startswith("//")]
    return out


def install_keda(go: str) -> None:
    comp, version = KEDA, versions.KEDA
    wd, log = comp.build_dir, comp.build_dir / "build.log"
    wd.mkdir(parents=True, exist_ok=True)
    env = _go_env()
    info = json.loads(gotool.run([go, "mod", "download", "-json", f"{MODULE}@{version}"],
                                 what=f"download of {MODULE}@{version}", log=log, cwd=wd, env=env))
    gomod = Path(info["GoMod"]).read_text()
    lines = [f"module atom.dev/kedabuild\n\ngo {versions.KEDA_GO.removeprefix('go')}\n",
             f"require {MODULE} {version}\n", *_directives(gomod), ""]
    (wd / "go.mod").write_text("\n".join(lines))
    (wd / "go.sum").unlink(missing_ok=True)
    imports = "\n".join(f'\t_ "{MODULE}/{pkg}"' for pkg in COMMANDS.values())
    (wd / "tools.go").write_text(f"//go:build tools\n\npackage tools\n\nimport (\n{imports}\n)\n")
    pkgs = [f"{MODULE}/{pkg}" for pkg in COMMANDS.values()]
    gotool.run([go, "get", *[f"{p}@{version}" for p in pkgs]],
               what="go get of KEDA's operator and metrics server", log=log, cwd=wd, env=env)
    out = wd / "out"
    shutil.rmtree(out, ignore_errors=True)
    flags = {f"{MODULE}/version.Version": version.lstrip("v")}
    gotool.run([go, "build", "-ldflags", gotool.ldflags_x(flags), "-o", f"{out}/", *pkgs],
               what="build of KEDA (operator, metrics server)", log=log, cwd=wd, env=env)
    for binary, pkg in COMMANDS.items():
        (out / pkg.rsplit("/", 1)[-1]).rename(out / binary)
    reported = {binary: _module_version(go, out / binary, env) for binary in COMMANDS}
    crds = wd / "crds"
    shutil.rmtree(crds, ignore_errors=True)
    shutil.copytree(Path(info["Dir"]) / CRD_DIR, crds)
    publish(comp, out, reported, {"crds": crds})


def _module_version(go: str, binary: Path, env: dict[str, str]) -> str:
    """The KEDA module version linked into `binary` (neither command has a --version flag)."""
    proc = subprocess.run([go, "version", "-m", str(binary)], capture_output=True, text=True,
                          env=env)
    line = next((ln for ln in proc.stdout.splitlines() if f"\t{MODULE}\t" in f"{ln}\t"), "")
    if versions.KEDA not in line:
        raise ProvisionError(f"{binary.name} does not link {MODULE} {versions.KEDA}: "
                             f"{proc.stdout[-400:]!r}")
    return line.strip()


def crd_dir() -> Path:
    """KEDA's CRDs (ScaledObject, ScaledJob, TriggerAuthentication...) copied from its module."""
    return KEDA.bin_dir / "crds"


# --- running it ---------------------------------------------------------------------------

Spawn = Callable[..., Process]  # LocalCluster._spawn(name, argv, env=None)
Wait = Callable[[str, Callable[[], bool]], None]  # LocalCluster._wait(what, done)
Kubectl = Callable[..., subprocess.CompletedProcess]  # LocalCluster.kubectl(*args, check=...)


def _openssl(*args: str) -> None:
    openssl = shutil.which("openssl")
    if not openssl:
        raise ProvisionError("openssl not found: KEDA's certificates are generated with it")
    subprocess.run([openssl, *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Certs:
    dir: Path

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def generate(self) -> None:
        """One CA; tls.crt serves the metrics API and both ends of KEDA's gRPC (mutual TLS,
        as in its chart); proxy.crt is the API server's front-proxy client certificate."""
        self.dir.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                 "-keyout", self.path("ca.key"), "-out", self.path("ca.crt"),
                 "-subj", "/CN=atom-local-keda-ca")
        sans = ",".join(["DNS:localhost", "IP:127.0.0.1", f"DNS:{METRICS_SERVICE}.{NAMESPACE}.svc",
                         f"DNS:keda-operator.{NAMESPACE}.svc"])
        self._leaf("tls", "keda", f"subjectAltName={sans}\nextendedKeyUsage=serverAuth,clientAuth")
        self._leaf("proxy", PROXY_CN, "extendedKeyUsage=clientAuth")

    def _leaf(self, name: str, cn: str, ext: str) -> None:
        (self.dir / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", self.path(f"{name}.key"),
                 "-out", self.path(f"{name}.csr"), "-subj", f"/CN={cn}")
        _openssl("x509", "-req", "-in", self.path(f"{name}.csr"), "-CA", self.path("ca.crt"),
                 "-CAkey", self.path("ca.key"), "-CAcreateserial", "-days", "2",
                 "-extfile", self.path(f"{name}.ext"), "-out", self.path(f"{name}.crt"))


class KedaAddon:
    """KEDA's operator and metrics API server as host processes of one LocalCluster."""

    def __init__(self, directory: Path, kubeconfig: str, spawn: Spawn, wait: Wait,
                 ports: list[int]) -> None:
        if not KEDA.is_installed():
            raise ProvisionError(f"KEDA {versions.KEDA} is not built into {KEDA.bin_dir}: run "
                                 "`hack/controlplane install --addons`")
        self.certs = Certs(directory / "certs")
        self.kubeconfig = kubeconfig
        self._spawn, self._wait = spawn, wait
        self.apiserver_port, self.grpc_port, *self._other_ports = ports

    def apiserver_flags(self) -> list[str]:
        """kube-apiserver flags for the aggregation layer (requestheader authentication of
        the user it forwards, and its client certificate towards KEDA)."""
        self.certs.generate()
        return [
            f"--requestheader-client-ca-file={self.certs.path('ca.crt')}",
            f"--requestheader-allowed-names={PROXY_CN}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={self.certs.path('proxy.crt')}",
            f"--proxy-client-key-file={self.certs.path('proxy.key')}",
        ]

    def start(self, kubectl: Kubectl) -> None:
        """CRDs, the namespace and the APIService, then both processes; returns once the
        external metrics API is Available through the API server."""
        kubectl("apply", "--server-side", "-f", str(crd_dir()))
        kubectl("apply", "--server-side", "-f", "-", input=json.dumps(self._objects()))
        env = {"KUBECONFIG": self.kubeconfig, "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE,
               "WATCH_NAMESPACE": ""}
        op_metrics, op_health, adapter_metrics = self._other_ports
        certs = str(self.certs.dir)
        self._spawn("keda-operator", [
            str(KEDA.path("keda")), f"--kubeconfig={self.kubeconfig}", "--leader-elect=false",
            f"--metrics-bind-address=127.0.0.1:{op_metrics}",
            f"--health-probe-bind-address=127.0.0.1:{op_health}",
            f"--metrics-service-bind-address=127.0.0.1:{self.grpc_port}", f"--cert-dir={certs}",
            "--enable-cert-rotation=false", "--enable-webhook-patching=false",
            "--enable-apiservice-patching=false", "--zap-log-level=info", "--zap-encoder=console",
        ], env=_with_path(env))
        self._spawn("keda-metrics-apiserver", [
            str(KEDA.path("keda-adapter")), f"--secure-port={self.apiserver_port}",
            "--bind-address=127.0.0.1", f"--cert-dir={certs}",
            f"--tls-cert-file={self.certs.path('tls.crt')}",
            f"--tls-private-key-file={self.certs.path('tls.key')}",
            f"--client-ca-file={self.certs.path('ca.crt')}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}", f"--lister-kubeconfig={self.kubeconfig}",
            f"--metrics-service-address=127.0.0.1:{self.grpc_port}",
            "--metrics-service-grpc-authority=localhost", f"--port={adapter_metrics}",
            "--zap-log-level=info", "--zap-encoder=console",
        ], env=_with_path(env))
        self._wait("the external metrics API (KEDA) to be Available",
                   lambda: _available(kubectl))

    def _objects(self) -> dict:
        ca_bundle = _b64(Path(self.certs.path("ca.crt")).read_bytes())
        items = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            # The API server runs on this host: the aggregator dials localhost:<port>.
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": METRICS_SERVICE, "namespace": NAMESPACE},
             "spec": {"type": "ExternalName", "externalName": "localhost",
                      "ports": [{"name": "https", "port": self.apiserver_port}]}},
            {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
             "metadata": {"name": APISERVICE},
             "spec": {"service": {"name": METRICS_SERVICE, "namespace": NAMESPACE,
                                  "port": self.apiserver_port},
                      "group": "external.metrics.k8s.io", "version": "v1beta1",
                      "caBundle": ca_bundle, "groupPriorityMinimum": 100,
                      "versionPriority": 100}},
        ]
        return {"apiVersion": "v1", "kind": "List", "items": items}


PORTS = 5  # free ports a KedaAddon takes: metrics API, gRPC, operator metrics/health, adapter


def _with_path(env: dict[str, str]) -> dict[str, str]:
    return dict(os.environ) | env


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _available(kubectl: Kubectl) -> bool:
    got = kubectl("get", f"apiservice/{APISERVICE}", "-o", "json", check=False)
    if got.returncode != 0:
        return False
    conditions = json.loads(got.stdout).get("status", {}).get("conditions") or []
    return any(c.get("type") == "Available" and c.get("status") == "True" for c in conditions)
