"""One real node beside the kwok nodes: containerd, kubelet, CNI bridge, kube-proxy, CoreDNS and
a hostPath volume provisioner, all host processes of the launcher.

The node is tainted (`atom.dev/real-node=true:NoSchedule`) so only pods that tolerate it land
there. containerd's root (its images) persists in the cache, so imported images survive from
one cluster to the next; everything else lives in the cluster's directory. Teardown removes
what the node made outside it: mounts, the cni0 bridge, network namespaces, KUBE-/CNI- iptables
chains, cgroups, and it restores the sysctls the CNI and kube-proxy switch on.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import cache, manifests
from .errors import ClusterError, ProvisionError
from .nodeprovision import PAUSE_IMAGE
from .procs import Process

NODE_NAME = "atom-node"
TAINT_KEY = "atom.dev/real-node"
NODE_POD_CIDR = "10.245.0.0/24"
BRIDGE = "cni0"
CLUSTER_DNS = "10.0.0.10"
DNS_PORT = 10053  # CoreDNS's port on the node IP; the kube-dns Service maps 53 to it
STORAGE_CLASS = "atom-local-path"
CNI_BIN = "/usr/lib/cni"
SYSCTLS = (
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
)


def node_ip() -> str:
    """The address of the default route's interface (pods reach the API server there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("198.51.100.1", 9))  # UDP: no packet is sent, this only picks a route
        except OSError as exc:
            raise ClusterError(f"the real node needs a default route: {exc}") from exc
        ip = sock.getsockname()[0]
    if ip.startswith("127."):
        raise ClusterError("the real node needs a non-loopback address (no default route)")
    return ip


def containerd_root() -> Path:
    return cache.cache_dir() / "node" / "containerd"


@dataclass(frozen=True)
class NodePorts:
    kubelet: int
    kubelet_healthz: int
    proxy_healthz: int
    proxy_metrics: int
    dns_health: int
    dns_ready: int


class RealNode:
    """Started and stopped by LocalCluster; `spawn` registers each process with the launcher."""

    def __init__(
        self,
        dir: Path,
        kubeconfig: str,
        spawn: Callable[..., Process],
        wait: Callable[[str, Callable[[], bool]], None],
        ports: list[int],
    ) -> None:
        self.dir, self.kubeconfig = dir, kubeconfig
        self._spawn, self._wait = spawn, wait
        self.ip = node_ip()
        self.ports = NodePorts(*ports)
        self.socket = dir / "run" / "containerd.sock"
        self.sysctls: dict[str, str] = {}
        self._lock: object | None = None

    # --- helpers -----------------------------------------------------------------------------
    def ctr(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 600,
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [
                str(cache.CONTAINERD.path("ctr")),
                "--address",
                str(self.socket),
                "--namespace",
                "k8s.io",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"ctr {' '.join(args)} failed: {proc.stderr.strip()[-800:]}")
        return proc

    def _ctr_argv(self, *args: str) -> list[str]:
        return [str(cache.CONTAINERD.path("ctr")), "--address", str(self.socket),
                "--namespace", "k8s.io", *args]  # fmt: skip

    def images(self) -> set[str]:
        return set(self.ctr("images", "ls", "-q").stdout.split())

    def import_image(self, source: Path, ref: str) -> bool:
        """Import an OCI archive or image layout directory unless `ref` is there already;
        True when imported. A layout streams in as a tar (no archive written to disk)."""
        if ref in self.images():
            return False
        if source.is_dir():
            tar = subprocess.Popen(["tar", "-C", str(source), "-cf", "-", "."],
                                   stdout=subprocess.PIPE)  # fmt: skip
            try:
                proc = subprocess.run(self._ctr_argv("images", "import", "-"), stdin=tar.stdout,
                                      capture_output=True, text=True, timeout=1800)  # fmt: skip
            finally:
                tar.wait()
            if proc.returncode != 0:
                raise ClusterError(f"importing {source} failed: {proc.stderr.strip()[-800:]}")
        else:
            self.ctr("images", "import", str(source))
        if ref not in self.images():
            raise ClusterError(f"importing {source} did not give {ref}: {sorted(self.images())}")
        return True

    # --- startup -----------------------------------------------------------------------------
    def start(self) -> None:
        self._take_lock()
        for key in SYSCTLS:
            try:
                self.sysctls[key] = Path("/proc/sys", key).read_text().strip()
            except OSError:
                pass
        for sub in ("run", "cni/net.d", "cni/ipam", "kubelet", "pod-logs", "volumes"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self._write_configs()
        path = os.pathsep.join(
            [str(cache.CONTAINERD.bin_dir), "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
        )
        env = dict(os.environ, PATH=path)
        self._spawn(
            "containerd",
            [str(cache.CONTAINERD.path()), "--config", str(self.dir / "containerd.toml")],
            env,
        )
        self._wait(
            "containerd",
            lambda: (
                self.socket.exists()
                and self.ctr("version", check=False, timeout=10).returncode == 0
            ),
        )
        self.import_image(cache.PAUSE.path("pause.tar"), PAUSE_IMAGE)
        self._spawn(
            "kubelet",
            [
                str(cache.KUBE_NODE.path("kubelet")),
                f"--config={self.dir / 'kubelet.yaml'}",
                f"--kubeconfig={self.kubeconfig}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={self.ip}",
                f"--root-dir={self.dir / 'kubelet'}",
                f"--cert-dir={self.dir / 'kubelet-certs'}",
                f"--node-labels=type=real,{TAINT_KEY}=true",
                f"--register-with-taints={TAINT_KEY}=true:NoSchedule",
                "--v=1",
            ],
        )
        self._spawn(
            "kube-proxy",
            [
                str(cache.KUBE_NODE.path("kube-proxy")),
                f"--config={self.dir / 'kube-proxy.yaml'}",
            ],
        )
        self._spawn("coredns", [str(cache.COREDNS.path()), "-conf", str(self.dir / "Corefile")])
        devtools = str(Path(__file__).resolve().parents[2])
        pythonpath = os.pathsep.join(p for p in (devtools, os.environ.get("PYTHONPATH")) if p)
        self._spawn(
            "volume-provisioner",
            [
                sys.executable,
                "-m",
                "atom_devtools.devcluster.provisioner",
                "--kubeconfig",
                self.kubeconfig,
                "--root",
                str(self.dir / "volumes"),
                "--node",
                NODE_NAME,
                "--class",
                STORAGE_CLASS,
            ],
            dict(os.environ, PYTHONPATH=pythonpath),
        )

    def objects(self) -> list[tuple[str, dict]]:
        """API objects the node needs: (collection path, object)."""
        return [
            ("/api/v1/namespaces/kube-system/services", manifests.dns_service(CLUSTER_DNS)),
            (
                "/apis/discovery.k8s.io/v1/namespaces/kube-system/endpointslices",
                manifests.dns_endpoints(self.ip, DNS_PORT),
            ),
            ("/apis/storage.k8s.io/v1/storageclasses", manifests.local_path_class(STORAGE_CLASS)),
        ]

    def dns_ready(self) -> bool:
        from .api import probe_http

        return probe_http(f"http://127.0.0.1:{self.ports.dns_ready}/ready")

    def _take_lock(self) -> None:
        # The kubelet and CNI use fixed host paths: one real node per machine.
        lock_path = cache.cache_dir() / "node" / ".lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fh = lock_path.open("w")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            fh.close()
            raise ClusterError(
                "another real node runs on this machine (one fits a machine: the "
                f"kubelet and CNI use fixed host paths); lock {lock_path}"
            ) from exc
        self._lock = fh

    def _write_configs(self) -> None:
        root = containerd_root()
        root.mkdir(parents=True, exist_ok=True)
        d = self.dir
        cri = "plugins.'io.containerd.cri.v1.runtime'"
        (d / "containerd.toml").write_text(f"""version = 4
root = "{root}"
state = "{d / "run" / "state"}"

[plugins.'io.containerd.server.v1.grpc']
  address = "{self.socket}"

[plugins.'io.containerd.server.v1.ttrpc']
  address = "{d / "run" / "containerd.sock.ttrpc"}"

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[{cri}]
  # without CAP_SYS_RESOURCE a container cannot lower its oom_score_adj
  restrict_oom_score_adj = true
  [{cri}.cni]
    bin_dirs = ["{CNI_BIN}"]
    conf_dir = "{d / "cni" / "net.d"}"
  [{cri}.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [{cri}.containerd.runtimes.runc.options]
      BinaryName = "/usr/sbin/runc"
      SystemdCgroup = false

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
""")
        (d / "cni" / "net.d" / "10-atom.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "atom",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": True,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "dataDir": str(d / "cni" / "ipam"),
                                "ranges": [[{"subnet": NODE_POD_CIDR}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                        {"type": "loopback"},
                    ],
                },
                indent=2,
            )
        )
        p = self.ports
        (d / "kubelet.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "address": self.ip,
                    "port": p.kubelet,
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": p.kubelet_healthz,
                    "authentication": {
                        "anonymous": {"enabled": True},
                        "webhook": {"enabled": False},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "cgroupDriver": "cgroupfs",
                    "failCgroupV1": False,
                    "failSwapOn": False,
                    "oomScoreAdj": 0,
                    "containerRuntimeEndpoint": f"unix://{self.socket}",
                    "imageServiceEndpoint": f"unix://{self.socket}",
                    # imported images can never be pulled again: never collect them
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "evictionHard": {
                        "memory.available": "100Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                        "nodefs.inodesFree": "1%",
                    },
                    "clusterDNS": [CLUSTER_DNS],
                    "clusterDomain": "cluster.local",
                    "podLogsDir": str(d / "pod-logs"),
                    "serializeImagePulls": False,
                    "syncFrequency": "5s",
                    "fileCheckFrequency": "5s",
                    "nodeStatusUpdateFrequency": "5s",
                    "podPidsLimit": -1,
                    "protectKernelDefaults": False,
                    "resolvConf": "/etc/resolv.conf",
                    "localStorageCapacityIsolation": False,
                },
                indent=2,
            )
        )
        (d / "kube-proxy.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "clientConnection": {"kubeconfig": self.kubeconfig},
                    "hostnameOverride": NODE_NAME,
                    "mode": "iptables",
                    "clusterCIDR": NODE_POD_CIDR,
                    "oomScoreAdj": 0,
                    # leave the conntrack sysctls alone (a container cannot set them)
                    "conntrack": {
                        "maxPerCore": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                    # no NodePorts on 127.0.0.1: kube-proxy would switch route_localnet on for them
                    "iptables": {"localhostNodePorts": False},
                    "healthzBindAddress": f"127.0.0.1:{p.proxy_healthz}",
                    "metricsBindAddress": f"127.0.0.1:{p.proxy_metrics}",
                    "nodePortAddresses": [f"{self.ip}/32"],
                },
                indent=2,
            )
        )
        (d / "Corefile").write_text(f""".:{DNS_PORT} {{
    bind {self.ip}
    errors
    health 127.0.0.1:{p.dns_health}
    ready 127.0.0.1:{p.dns_ready}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self.kubeconfig} atom-local
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    forward . /etc/resolv.conf
    cache 5
}}
""")

    # --- teardown ----------------------------------------------------------------------------
    def remove_containers(self) -> None:
        """Kill and remove every container left in containerd (pods the kubelet did not end)."""
        if not self.socket.exists():
            return
        for task in self.ctr("tasks", "ls", "-q", check=False, timeout=30).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False, timeout=30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            tasks = self.ctr("tasks", "ls", "-q", check=False, timeout=30).stdout.split()
            if not tasks:
                break
            for task in tasks:
                self.ctr("tasks", "rm", "-f", task, check=False, timeout=30)
            time.sleep(0.2)
        for cid in self.ctr("containers", "ls", "-q", check=False, timeout=30).stdout.split():
            self.ctr("containers", "rm", cid, check=False, timeout=30)
        for sandbox in self.ctr("sandboxes", "ls", "-q", check=False, timeout=30).stdout.split():
            self.ctr("sandboxes", "rm", "--force", sandbox, check=False, timeout=30)

    def cleanup_host(self) -> list[str]:
        """After every node process stopped: undo what they did to the host; returns problems."""
        problems: list[str] = []
        problems += _unmount_under([self.dir, containerd_root()])
        for ns in _list_netns():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        if Path(f"/sys/class/net/{BRIDGE}").exists():
            subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
        for tool in ("iptables", "ip6tables"):
            problems += _drop_chains(tool)
        for key, value in self.sysctls.items():
            try:
                Path("/proc/sys", key).write_text(value)
            except OSError as exc:
                problems.append(f"restoring {key}: {exc}")
        _remove_cgroups()
        logs = Path("/var/log/containers")
        if logs.is_dir():
            for link in logs.iterdir():
                if link.is_symlink() and str(os.readlink(link)).startswith(str(self.dir)):
                    link.unlink(missing_ok=True)
        if self._lock is not None:
            self._lock.close()  # type: ignore[attr-defined]
            self._lock = None
        return problems


def _mounts() -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        field = line.split()[4]
        points.append(field.encode().decode("unicode_escape"))
    return points


def _unmount_under(roots: list[Path]) -> list[str]:
    prefixes = [str(r.resolve()) for r in roots]
    targets = [m for m in _mounts() if any(m == p or m.startswith(p + "/") for p in prefixes)]
    problems = []
    for target in sorted(targets, key=len, reverse=True):  # deepest first
        proc = subprocess.run(["umount", "-l", target], capture_output=True, text=True)
        if proc.returncode != 0 and Path(target).exists():
            problems.append(f"umount {target}: {proc.stderr.strip()}")
    return problems


def _list_netns() -> list[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [
        line.split()[0]
        for line in proc.stdout.splitlines()
        if line.split() and line.split()[0].startswith("cni-")
    ]


def _drop_chains(tool: str) -> list[str]:
    """Remove every KUBE-* and CNI-* chain and the rules that jump to them."""
    if not shutil.which(f"{tool}-save"):
        return []
    saved = subprocess.run([f"{tool}-save"], capture_output=True, text=True).stdout
    if "KUBE-" not in saved and "CNI-" not in saved:
        return []
    kept = [line for line in saved.splitlines() if "KUBE-" not in line and "CNI-" not in line]
    proc = subprocess.run(
        [f"{tool}-restore"], input="\n".join(kept) + "\n", capture_output=True, text=True
    )
    return [f"{tool}-restore: {proc.stderr.strip()}"] if proc.returncode != 0 else []


def _remove_cgroups() -> None:
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / "kubepods"
        if not top.is_dir():
            continue
        for path in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            try:
                path.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


def leftovers(node_dir: Path) -> list[str]:
    """What a stopped node left behind (empty when the teardown was clean): for tests."""
    found = []
    prefixes = [str(node_dir), str(containerd_root())]
    found += [f"mount {m}" for m in _mounts() if any(m.startswith(p) for p in prefixes)]
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        found.append(f"interface {BRIDGE}")
    found += [f"netns {ns}" for ns in _list_netns()]
    for tool in ("iptables", "ip6tables"):
        if shutil.which(f"{tool}-save"):
            saved = subprocess.run([f"{tool}-save"], capture_output=True, text=True).stdout
            found += [
                f"{tool}: {line}"
                for line in saved.splitlines()
                if "KUBE-" in line or "CNI-" in line
            ][:5]
    return found


def require_root() -> None:
    if os.geteuid() != 0:
        raise ProvisionError("the real node needs root (containerd, kubelet, CNI, iptables)")
