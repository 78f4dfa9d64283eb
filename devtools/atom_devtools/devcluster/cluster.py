"""`LocalCluster`: etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok as
local processes on 127.0.0.1, free ports, one temporary directory (logs, certs, kubeconfig);
with `flux=True` also Flux's source-controller and kustomize-controller (flux.py)."""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from . import cache, manifests
from .api import ApiClient, probe
from .errors import ClusterError, ProvisionError
from .flux import FLUX, Flux
from .keda import PORTS as KEDA_PORTS
from .keda import KedaAddon
from .procs import Process, free_ports, stop_all
from .provision import require
from .realnode import NODE_NAME, RealNode, require_root

SERVICE_CIDR = "10.0.0.0/24"
POD_CIDR = "10.244.0.0/16"


class KubectlError(subprocess.CalledProcessError):
    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def _sa_key(path: Path) -> None:
    openssl = shutil.which("openssl")
    if not openssl:
        raise ProvisionError(
            "openssl not found: the launcher needs it to generate the service-account signing key"
        )
    subprocess.run([openssl, "genrsa", "-out", str(path), "2048"], check=True,
                   capture_output=True)


class LocalCluster:
    """A real Kubernetes control plane with fake (kwok) GPU nodes; a context manager.

    Startup failures raise ClusterError carrying the failing component's log tail, and keep
    the directory for inspection; a clean exit removes it unless `keep=True`.
    """

    def __init__(self, *, nodes: int = 2, keep: bool = False, timeout: float = 120,
                 log: Callable[[str], None] | None = None, real_node: bool = False,
                 keda: bool = False, flux: bool = False) -> None:
        self.node_names = [f"kwok-node-{i}" for i in range(nodes)]
        self.real_node = real_node
        self.node: RealNode | None = None
        self.with_keda = keda  # KEDA's operator and metrics API server (keda.py)
        self.keda: KedaAddon | None = None
        self.with_flux = flux  # Flux's source-controller and kustomize-controller (flux.py)
        self.flux: Flux | None = None
        self.keep = keep
        self.timeout = timeout
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.procs: list[Process] = []
        self.dir: Path | None = None
        self.token = secrets.token_hex(16)
        self.server = ""
        self.api: ApiClient | None = None
        self.started_in: float | None = None

    # --- public API ----------------------------------------------------------------------
    @property
    def kubeconfig(self) -> str:
        return str(self._path("kubeconfig"))

    @property
    def ca_file(self) -> str:
        return str(self._path("certs", "apiserver.crt"))

    def env(self) -> dict[str, str]:
        """The current environment with KUBECONFIG set and the cached binaries first on PATH."""
        path = os.pathsep.join([str(p) for p in cache.bin_path()] + [os.environ.get("PATH", "")])
        return dict(os.environ, KUBECONFIG=self.kubeconfig, PATH=path)

    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 60) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(cache.KUBECTL.path()), "--kubeconfig", self.kubeconfig, *args],
                              capture_output=True, text=True, input=input, timeout=timeout,
                              env=self.env())
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        require(real_node=self.real_node)
        if self.real_node:
            require_root()
        if self.with_flux and not FLUX.is_installed():
            raise ProvisionError(f"the Flux controllers are missing from {FLUX.bin_dir}: run "
                                 "`hack/controlplane install --addons flux`")
        begin = time.monotonic()
        self.dir = Path(tempfile.mkdtemp(prefix="atom-cluster-"))
        atexit.register(self.stop)
        try:
            self._start()
        except BaseException as exc:  # Ctrl-C during startup included: never leave processes
            self._stop_processes()
            if isinstance(exc, ClusterError):  # keep the directory: its logs explain why
                atexit.unregister(self.stop)
                exc.args = (f"{exc.args[0]}\n(logs kept in {self.dir / 'logs'})",)
                self.dir = None
            else:
                self.stop()
            raise
        self.started_in = time.monotonic() - begin
        self._log(f"local cluster ready in {self.started_in:.1f}s: {self.server} "
                  f"(kubeconfig {self.kubeconfig})")

    def stop(self) -> None:
        atexit.unregister(self.stop)
        self._stop_processes()
        if self.dir is not None and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    # --- startup -------------------------------------------------------------------------
    def _path(self, *parts: str) -> Path:
        if self.dir is None:
            raise ClusterError("the cluster is not started")
        return self.dir.joinpath(*parts)

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Process:
        proc = Process(name, argv, self._path("logs", f"{name}.log"), env=env)
        proc.start()
        self.procs.append(proc)
        return proc

    def _apiserver_address_flags(self) -> list[str]:
        if self.node is None:
            # no default route on CI hosts: without these two the server fails to start
            return ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
                    "--endpoint-reconciler-type=none"]
        # Pods reach the API server through the `kubernetes` Service: its endpoint (written by
        # the lease reconciler) is the node IP; logs and port-forward go to the kubelet's IP.
        return ["--bind-address=0.0.0.0", f"--advertise-address={self.node.ip}",
                "--kubelet-preferred-address-types=InternalIP,Hostname"]

    def _start(self) -> None:
        etcd_port, peer_port, api_port, kcm_port, sched_port, *node_ports = free_ports(11)
        if self.with_keda:
            self.keda = KedaAddon(self._path("keda"), self.kubeconfig, self._spawn, self._wait,
                                  free_ports(KEDA_PORTS))
        if self.real_node:
            self.node = RealNode(self._path(), self.kubeconfig, self._spawn, self._wait,
                                 node_ports)
        # The API server's self-signed certificate names its advertised address (and not
        # 127.0.0.1 when that is the node's): clients use the address it names.
        self.server = f"https://{self.node.ip if self.node else '127.0.0.1'}:{api_port}"
        _sa_key(self._path("sa.key"))
        self._path("tokens.csv").write_text(f'{self.token},admin,admin,"system:masters"\n')
        etcd = f"http://127.0.0.1:{etcd_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        # etcd and the API server start together: the API server retries until etcd answers.
        self._spawn("etcd", [
            str(cache.ETCD.path()), "--name=default", f"--data-dir={self._path('etcd')}",
            "--unsafe-no-fsync", f"--listen-client-urls={etcd}", f"--advertise-client-urls={etcd}",
            f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}", "--log-level=warn",
        ])
        sa_key = str(self._path("sa.key"))
        self._spawn("kube-apiserver", [
            str(cache.KUBERNETES.path("kube-apiserver")), f"--etcd-servers={etcd}",
            f"--secure-port={api_port}", f"--cert-dir={self._path('certs')}",
            *self._apiserver_address_flags(),
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={sa_key}", f"--service-account-signing-key-file={sa_key}",
            f"--token-auth-file={self._path('tokens.csv')}", "--authorization-mode=RBAC",
            "--allow-privileged=true", "--profiling=false",
            *(self.keda.apiserver_flags() if self.keda else []),
        ])
        self._wait("the API server's certificate", lambda: Path(self.ca_file).is_file())
        self.api = api = ApiClient(self.server, self.token, self.ca_file)
        self._wait("kube-apiserver /readyz", lambda: api.get("/readyz")[0] == 200)
        self._write_kubeconfig()

        kubeconfig = self.kubeconfig
        auth = [f"--kubeconfig={kubeconfig}", f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--leader-elect=false",
                "--bind-address=127.0.0.1"]
        self._spawn("kube-controller-manager", [
            str(cache.KUBERNETES.path("kube-controller-manager")), *auth,
            f"--secure-port={kcm_port}", f"--cert-dir={self._path('kcm-certs')}",
            f"--service-account-private-key-file={sa_key}", f"--root-ca-file={self.ca_file}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
        ])
        self._spawn("kube-scheduler", [
            str(cache.KUBERNETES.path("kube-scheduler")), *auth,
            f"--secure-port={sched_port}", f"--cert-dir={self._path('scheduler-certs')}",
        ])
        self._path("kwok.yaml").write_text(manifests.kwok_config(cache.kwok_stages_dir()))
        self._spawn("kwok", [
            str(cache.KWOK.path()), f"--kubeconfig={kubeconfig}",
            f"--config={self._path('kwok.yaml')}",
            f"--manage-nodes-with-annotation-selector={manifests.KWOK_ANNOTATION}=fake",
            f"--cidr={POD_CIDR}", "--node-lease-duration-seconds=40",
        ])
        self._create("/apis/storage.k8s.io/v1/storageclasses",
                     manifests.storage_class(default=not self.real_node))
        for i, name in enumerate(self.node_names):
            self._create("/api/v1/nodes", manifests.node(name, i))
        if self.node is not None:
            self.node.start()
            for path, obj in self.node.objects():
                self._create(path, obj)

        self._wait("kube-controller-manager /healthz",
                   lambda: probe(f"https://127.0.0.1:{kcm_port}/healthz"))
        self._wait("kube-scheduler /healthz",
                   lambda: probe(f"https://127.0.0.1:{sched_port}/healthz"))
        self._wait("the nodes to be Ready", self._nodes_ready)
        if self.node is not None:
            self._wait("CoreDNS /ready", self.node.dns_ready)
        # The controller-manager creates it; pods cannot be admitted before it exists.
        self._wait("the default ServiceAccount", lambda: api.get(
            "/api/v1/namespaces/default/serviceaccounts/default")[0] == 200)
        if self.with_flux:
            self.flux = Flux(self.kubeconfig, self._path("flux"), self.timeout)
            try:
                self.flux.start()
            finally:  # stopped with the other clients, even when its start fails
                self.procs += self.flux.procs
        if self.keda is not None:
            self.keda.start(self.kubectl)

    def _client(self) -> ApiClient:
        assert self.api is not None, "the API server is started first"
        return self.api

    def _create(self, path: str, obj: dict) -> None:
        status, body = self._client().create(path, obj)
        if status not in (200, 201, 409):
            raise ClusterError(f"creating {obj['kind']} {obj['metadata']['name']} failed: "
                               f"{status} {body}")

    def _nodes_ready(self) -> bool:
        status, body = self._client().get("/api/v1/nodes")
        if status != 200:
            return False
        ready = {
            n["metadata"]["name"] for n in body.get("items", [])
            if any(c["type"] == "Ready" and c["status"] == "True"
                   for c in n.get("status", {}).get("conditions", []))
        }
        return ready >= set(self.node_names) | ({NODE_NAME} if self.node else set())

    def _wait(self, what: str, done: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            for proc in self.procs:
                if not proc.alive:
                    raise ClusterError(f"{proc.describe_exit()}\n(while waiting for {what})")
            try:
                if done():
                    return
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                logs = "\n\n".join(p.describe_exit() for p in self.procs)
                raise ClusterError(f"timed out after {self.timeout:.0f}s waiting for {what}\n{logs}")
            time.sleep(0.2)

    def _write_kubeconfig(self) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "atom-local",
                          "cluster": {"server": self.server, "certificate-authority": self.ca_file}}],
            "users": [{"name": "admin", "user": {"token": self.token}}],
            "contexts": [{"name": "atom-local",
                          "context": {"cluster": "atom-local", "user": "admin",
                                      "namespace": "default"}}],
            "current-context": "atom-local",
        }
        # JSON is YAML: kubectl, helm, kopf and the kubernetes client all read it.
        path = self._path("kubeconfig")
        path.write_text(json.dumps(config, indent=2) + "\n")
        path.chmod(0o600)

    def _stop_processes(self) -> None:
        # Clients first, then the API server, then etcd: a server whose backend is gone, or
        # etcd with watches still open, each stall their graceful shutdown. On a real node the
        # kubelet goes first, then the containers it left, then containerd.
        procs, self.procs = self.procs, []
        node_side = ("kubelet", "containerd")
        order = [[p for p in procs if p.name == "kubelet"],
                 [p for p in procs if p.name not in ("kube-apiserver", "etcd", *node_side)],
                 [p for p in procs if p.name == "kube-apiserver"],
                 [p for p in procs if p.name == "etcd"]]
        node, self.node = self.node, None
        for i, group in enumerate(order):
            stop_all(group)
            if i == 0 and node is not None:
                node.remove_containers()
                stop_all([p for p in procs if p.name == "containerd"])
        if node is not None:
            for problem in node.cleanup_host():
                self._log(f"real node teardown: {problem}")
