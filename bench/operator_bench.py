"""Operator benchmark on the local control plane (real API server, kwok nodes).

1. Raw baseline: create, straight through the API, the same child objects the operator makes for
   one unified AtomDeployment (ConfigMap, Service, Deployment), N times; time until all those
   Deployments are ready.
2. Operator: apply N AtomDeployments at once; time until every one reports Ready.
Also: reconcile latency p50/p99 (from the operator's /healthz probe) and operator peak RSS.

    python bench/operator_bench.py --count 200 --out bench/operator_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from atom_operator import builders
from atom_operator.builders import Owner
from atom_operator.devcluster import LocalCluster
from atom_operator.kube import Kube
from atom_operator.models import AtomDeploymentSpec
from atom_operator.snapshot import Snapshot, deployment_complete
from common import REPO, Served, free_port, wait_for

RAW_NS, OP_NS = "bench-raw", "bench-operator"
# No GPU requests and no cache claim: the local cluster has no provisioner, and we measure the
# control plane, not scheduling limits.
SPEC: dict[str, Any] = {
    "model": {"name": "tiny-llama", "loadFormat": "dummy"},
    "compilation": {"level": 3, "cudagraphMode": "FULL", "cudagraphCaptureSizes": [1, 2, 4, 8]},
    "compileCache": {"enabled": False},
    "resources": {},
    "replicas": 1,
}


def raw_children(name: str) -> list[dict[str, Any]]:
    """Exactly what the operator would apply for one AtomDeployment, minus ownerReferences."""
    spec = AtomDeploymentSpec.model_validate(SPEC)
    plan = builders.plan(Owner(name, RAW_NS, "raw"), spec, "atom-runtime:bench", Snapshot())
    out = []
    for obj in plan.apply:
        obj = json.loads(json.dumps(obj))
        obj["metadata"].pop("ownerReferences", None)
        out.append(obj)
    return out


def timed_parallel(fn, items: list[Any], workers: int = 16) -> float:
    start = time.monotonic()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(fn, items))
    return time.monotonic() - start


def count_ready(kube: Kube, ns: str) -> int:
    deps = kube.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments").get("items", [])
    return sum(deployment_complete(d) for d in deps)


def run_raw(kube: Kube, count: int) -> dict[str, float]:
    objs = [o for i in range(count) for o in raw_children(f"m{i}")]
    start = time.monotonic()
    create_s = timed_parallel(kube.apply, objs)
    wait_for(
        lambda: count_ready(kube, RAW_NS) >= count,
        timeout=900,
        what="raw Deployments ready",
        interval=1,
    )
    return {
        "objects": len(objs),
        "create_s": create_s,
        "objects_per_s": len(objs) / create_s,
        "all_ready_s": time.monotonic() - start,
    }


def install_crd(cluster: LocalCluster) -> None:
    """Apply the generated CRD and poll until it is served (`kubectl wait` fails while the CRD
    has no conditions yet)."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "atomdeployment.yaml"))
    established = "jsonpath={.status.conditions[?(@.type=='Established')].status}"
    crd = ("get", "crd", "atomdeployments.atom.dev", "-o", established)
    wait_for(lambda: cluster.kubectl(*crd, check=False).stdout.strip() == "True",
             timeout=60, what="CRD Established")  # fmt: skip


def start_operator(cluster: LocalCluster, interval: float) -> Served:
    """`python -m atom_operator.main` on the cluster, watching the benchmark's namespace."""
    port = free_port()
    env = {**cluster.env(), "ATOM_OPERATOR_NAMESPACES": OP_NS,
           "ATOM_OPERATOR_RECONCILE_INTERVAL": str(interval),
           "ATOM_OPERATOR_HEALTH_PORT": str(port),
           "ATOM_OPERATOR_DEFAULT_IMAGE": "atom-runtime:e2e",
           "ATOM_OPERATOR_LOG_LEVEL": "WARNING"}  # fmt: skip
    return Served(["atom_operator.main"], port, "atom-operator", health="/healthz", env=env)


def is_ready(obj: dict[str, Any]) -> bool:
    """Ready at the current generation: phase and condition both."""
    status = obj.get("status") or {}
    ready = {c["type"]: c["status"] for c in status.get("conditions") or []}.get("Ready")
    current = status.get("observedGeneration") == obj["metadata"]["generation"]
    return current and status.get("phase") == "Ready" and ready == "True"


def atomd(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": name, "namespace": OP_NS},
        "spec": SPEC,
    }


def run_operator(kube: Kube, count: int) -> dict[str, float]:
    docs = [atomd(f"m{i}") for i in range(count)]
    start = time.monotonic()
    # All at once: parallel server-side applies, as a GitOps sync of a large repository would.
    applied_s = timed_parallel(lambda d: kube.apply(d, manager="bench-user"), docs)

    def all_ready() -> bool:
        items = kube.request(
            "GET", f"/apis/atom.dev/v1alpha1/namespaces/{OP_NS}/atomdeployments"
        ).get("items", [])
        return len(items) == count and all(is_ready(o) for o in items)

    wait_for(all_ready, timeout=1800, what="all AtomDeployments Ready", interval=1)
    return {"apply_s": applied_s, "all_ready_s": time.monotonic() - start}


def probe(op: Served) -> dict[str, Any]:
    with urllib.request.urlopen(op.health_url, timeout=5) as r:
        return json.loads(r.read()).get("reconcile", {})


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=6, help="kwok nodes (110 pods each)")
    parser.add_argument(
        "--interval", type=float, default=10.0, help="operator reconcile interval (s)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "operator_bench.json")
    args = parser.parse_args()

    with LocalCluster(nodes=args.nodes) as cluster:
        kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
        install_crd(cluster)
        for ns in (RAW_NS, OP_NS):
            cluster.kubectl("create", "namespace", ns, check=False)

        raw = run_raw(kube, args.count)
        cluster.kubectl("delete", "namespace", RAW_NS, "--wait=false")

        op = start_operator(cluster, args.interval)
        try:
            op.wait_healthy(60)
            operated = run_operator(kube, args.count)
            latency = probe(op)
            rss = peak_rss_mib(op.proc.pid)
        finally:
            op.stop()

    result = {
        "count": args.count,
        "reconcile_interval_s": args.interval,
        "raw": raw,
        "operator": operated,
        "slowdown_vs_raw": operated["all_ready_s"] / raw["all_ready_s"],
        "reconcile_latency_s": latency,
        "operator_peak_rss_mib": rss,
        "cpus": os.cpu_count(),
    }
    rows = [
        ("AtomDeployments", f"{args.count}"),
        (
            "raw: child objects created",
            f"{raw['objects']} in {raw['create_s']:.1f} s ({raw['objects_per_s']:.0f}/s)",
        ),
        ("raw: all Deployments ready", f"{raw['all_ready_s']:.1f} s"),
        ("operator: all AtomDeployments Ready", f"{operated['all_ready_s']:.1f} s"),
        ("operator / raw", f"{result['slowdown_vs_raw']:.2f}x"),
        (
            "reconcile latency p50 / p99",
            f"{latency.get('p50', float('nan')) * 1000:.0f} / {latency.get('p99', float('nan')) * 1000:.0f} ms"
            f" ({latency.get('count', 0)} reconciles)",
        ),
        ("operator peak RSS", f"{rss:.0f} MiB"),
    ]
    width = max(len(r[0]) for r in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
