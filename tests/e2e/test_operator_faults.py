"""The operator under faults on the real API server (issue 34): names at the limits, P/D specs
that cannot serve, capture sizes, non-BMP unicode, unschedulable pods, quotas, missing and
deleted claims, an HPA on a child, a failed apply retried with backoff, Events.

The operator's resync interval is 10 minutes here, so everything below is driven by events and
retries, never by the periodic pass.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from atomd_e2e import (
    Kubectl,
    OperatorProcess,
    atomd,
    condition,
    get,
    install_crd,
    is_ready,
    pre_bound_pv,
    running_operator,
)

from atom_operator import naming
from atom_operator.kube import Kube
from testutil import wait_for

NS, SC, TIMEOUT = "atomd-faults", "atomd-faults-manual", 90
pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, env: dict[str, str], tmp_path_factory) -> Iterator[OperatorProcess]:
    """No periodic pass within the tests (600 s): events and retries must do everything."""
    log = tmp_path_factory.mktemp("operator")
    with running_operator(kubectl, env, log, NS, ATOM_OPERATOR_RECONCILE_INTERVAL="600") as op:
        yield op


def _spec(**extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny-llama", "loadFormat": "dummy"},
        "engine": {"maxNumSeqs": 16},
        "compileCache": {"enabled": False},
    }
    spec.update(extra)
    return spec


def _obj(kube: Kube, name: str) -> dict[str, Any]:
    return get(kube, NS, name)


def _wait_ready(kube: Kube, name: str) -> dict[str, Any]:
    return wait_for(
        f"{name} Ready",
        lambda: (lambda o: o if is_ready(o) else None)(_obj(kube, name)),
        timeout=TIMEOUT,
    )


def _wait_degraded(kube: Kube, name: str, reason: str, timeout: float = TIMEOUT) -> dict:
    def degraded() -> dict | None:
        o = _obj(kube, name)
        d = condition(o, "Degraded")
        return o if d.get("status") == "True" and d.get("reason") == reason else None

    return wait_for(f"{name} Degraded {reason}", degraded, timeout=timeout)


def _delete(kubectl: Kubectl, name: str) -> None:
    kubectl("delete", "atomd", name, "-n", NS, "--wait=true", "--timeout=60s", check=False)


def _refused(kubectl: Kubectl, name: str, spec: dict[str, Any]) -> str:
    proc = kubectl.apply(atomd(name, NS, spec), "--dry-run=server", check=False)
    assert proc.returncode != 0, f"{name}: accepted"
    return proc.stderr


def _events(kubectl: Kubectl, name: str) -> list[dict[str, Any]]:
    out = kubectl(
        "get", "events", "-n", NS, "--field-selector", f"involvedObject.name={name}", "-o", "json"
    ).stdout
    return [e for e in json.loads(out)["items"] if e["involvedObject"]["kind"] == "AtomDeployment"]


def test_names_at_the_limits(operator, kubectl, kube) -> None:
    longest = "n" * 63
    kubectl.apply(atomd(longest, NS, _spec()))
    obj = _wait_ready(kube, longest)
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    assert kube.get("Service", NS, longest) is not None
    for length in (64, 253):
        err = _refused(kubectl, "n" * length, _spec())
        assert "metadata.name must be at most 63 characters" in err, err
        assert "app.kubernetes.io/instance" in err
    err = _refused(kubectl, "with.dots", _spec())
    assert "no dots" in err and "metadata.name" in err, err
    _delete(kubectl, longest)


@pytest.mark.parametrize("role", ["prefill", "decode", "router"])
def test_zero_replicas_for_a_disaggregated_role_refused(operator, kubectl, role: str) -> None:
    dis: dict[str, Any] = {"prefill": {}, "decode": {}, role: {"replicas": 0}}
    err = _refused(kubectl, "pd-zero", _spec(disaggregation=dis))
    assert f"spec.disaggregation.{role}.replicas" in err, err


def test_every_capture_size_list_checked_against_max_num_seqs(operator, kubectl) -> None:
    several = _spec(compilation={"cudaGraphSizes": [1, 2, 1024]})
    assert "spec.compilation.cudaGraphSizes" in _refused(kubectl, "sizes", several)
    per_role = _spec(
        disaggregation={
            "prefill": {"compilation": {"cudaGraphSizes": [1, 64]}},
            "decode": {},
        }
    )
    err = _refused(kubectl, "sizes", per_role)
    assert "spec.disaggregation.prefill.compilation.cudaGraphSizes" in err, err
    # one value is a pattern the runtime clamps to maxNumSeqs: accepted
    one = kubectl.apply(
        atomd("sizes", NS, _spec(compilation={"cudaGraphSizes": [1024]})),
        "--dry-run=server",
        check=False,
    )
    assert one.returncode == 0, one.stderr


def test_non_bmp_unicode_in_path_and_env_is_applied(operator, kubectl, kube) -> None:
    spec = _spec(
        model={"name": "llama", "path": "/models/🦙-weights", "loadFormat": "dummy"},
        env=[{"name": "GREETING", "value": "héllo 🚀 世界"}],
    )
    kubectl.apply(atomd("emoji", NS, spec))
    _wait_ready(kube, "emoji")
    container = kube.get("Deployment", NS, "emoji-unified")["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert "/models/🦙-weights" in container["args"]
    assert {"name": "GREETING", "value": "héllo 🚀 世界"} in container["env"]
    assert condition(_obj(kube, "emoji"), "Degraded")["status"] == "False"
    _delete(kubectl, "emoji")


def test_unschedulable_pods_degrade_with_the_reason_then_recover(operator, kubectl, kube) -> None:
    kubectl.apply(atomd("nowhere", NS, _spec(nodeSelector={"atom.dev/no-such-node": "x"})))
    obj = _wait_degraded(kube, "nowhere", "Unschedulable")
    assert "node affinity/selector" in condition(obj, "Degraded")["message"]
    assert "Unschedulable" in kubectl("get", "atomd", "nowhere", "-n", NS).stdout
    described = kubectl("describe", "atomd", "nowhere", "-n", NS).stdout
    assert "Warning" in described and "Unschedulable" in described, described
    warn = [e for e in _events(kubectl, "nowhere") if e["reason"] == "Unschedulable"]
    assert warn and warn[0]["type"] == "Warning"
    kubectl(
        "patch",
        "atomd",
        "nowhere",
        "-n",
        NS,
        "--type=merge",
        "-p",
        '{"spec":{"nodeSelector":null}}',
    )
    obj = _wait_ready(kube, "nowhere")
    assert condition(obj, "Degraded")["status"] == "False"
    assert "Recovered" in {e["reason"] for e in _events(kubectl, "nowhere")}
    _delete(kubectl, "nowhere")


def _quota(kubectl: Kubectl, kube: Kube, name: str, hard: dict[str, str]) -> None:
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "ResourceQuota",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"hard": hard},
        }
    )
    # Admission enforces a quota only once the controller has computed its usage.
    wait_for(
        f"quota {name} computed",
        lambda: (
            kube.request("GET", f"/api/v1/namespaces/{NS}/resourcequotas/{name}")
            .get("status", {})
            .get("hard")
        ),
        timeout=30,
    )


def _degraded_under_quota(
    kubectl: Kubectl,
    kube: Kube,
    name: str,
    hard: dict[str, str],
    reason: str,
    settled: Callable[[dict[str, Any]], bool] = lambda _: True,
) -> str:
    """Create `name` under a quota, wait for Degraded `reason` (and `settled`), lift the
    quota; Degraded's message."""
    _quota(kubectl, kube, f"{name}-quota", hard)
    try:
        kubectl.apply(atomd(name, NS, _spec()))
        msg = condition(_wait_degraded(kube, name, reason), "Degraded")["message"]
        wait_for(f"{name} settled", lambda: settled(_obj(kube, name)), timeout=TIMEOUT)
        return msg
    finally:
        kubectl("delete", "resourcequota", f"{name}-quota", "-n", NS)


def test_quota_refusal_is_failed_create_then_recovers(operator, kubectl, kube) -> None:
    msg = _degraded_under_quota(
        kubectl, kube, "quota", {"requests.nvidia.com/gpu": "0"}, "FailedCreate"
    )
    assert "exceeded quota" in msg
    _wait_ready(kube, "quota")
    _delete(kubectl, "quota")


def test_missing_existing_claim_degrades_then_recovers(operator, kubectl, kube, tmp_path) -> None:
    spec = _spec(compileCache={"existingClaim": "later-claim"})
    kubectl.apply(atomd("claimless", NS, spec))
    obj = _wait_degraded(kube, "claimless", "ClaimMissing")
    assert "later-claim" in condition(obj, "Degraded")["message"]
    kubectl.apply(pre_bound_pv(f"{NS}-later", NS, "later-claim", SC, tmp_path))
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "later-claim", "namespace": NS},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": SC,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        }
    )
    obj = _wait_ready(kube, "claimless")
    assert condition(obj, "CompileCacheReady")["status"] == "True"
    _delete(kubectl, "claimless")


def test_cache_claim_deleted_in_use_rolls_without_it_and_comes_back(
    operator, kubectl, kube, tmp_path
) -> None:
    claim = naming.pvc_name("cached")
    spec = _spec(compileCache={"storageClassName": SC, "size": "1Gi"})
    kubectl.apply(pre_bound_pv(f"{NS}-cached-1", NS, claim, SC, tmp_path))
    kubectl.apply(atomd("cached", NS, spec))
    before = _wait_ready(kube, "cached")
    old_uid = kube.get("PersistentVolumeClaim", NS, claim)["metadata"]["uid"]
    kubectl("delete", "pvc", claim, "-n", NS, "--wait=false")

    obj = _wait_degraded(kube, "cached", "ClaimTerminating")
    cache = condition(obj, "CompileCacheReady")
    assert cache["status"] == "False" and cache["reason"] == "ClaimTerminating"
    assert "without the compile cache" in cache["message"]
    # no deadlock: pods roll without the cache, the old pods go, the claim goes with them,
    # and the operator creates it again
    wait_for(
        "the claim recreated",
        lambda: (
            (kube.get("PersistentVolumeClaim", NS, claim) or {}).get("metadata", {}).get("uid")
            not in (None, old_uid)
        ),
        timeout=TIMEOUT,
    )
    kubectl.apply(pre_bound_pv(f"{NS}-cached-2", NS, claim, SC, tmp_path))
    after = wait_for(
        "cached Ready with its cache again",
        lambda: (
            lambda o: (
                o
                if is_ready(o) and condition(o, "CompileCacheReady").get("status") == "True"
                else None
            )
        )(_obj(kube, "cached")),
        timeout=TIMEOUT,
    )
    assert after["status"]["revision"] == before["status"]["revision"]
    _delete(kubectl, "cached")


def test_failed_apply_is_retried_with_backoff_not_at_the_resync(operator, kubectl, kube) -> None:
    def pods_ready(obj: dict[str, Any]) -> bool:  # no pod event left to trigger a reconcile
        return obj["status"]["roles"]["unified"]["readyReplicas"] == 1

    msg = _degraded_under_quota(
        kubectl, kube, "retry", {"services": "0"}, "ApplyFailed", settled=pods_ready
    )
    assert "Service retry" in msg
    lifted = time.monotonic()  # the quota went as _degraded_under_quota returned
    # nothing else happens to this object: only the operator's own retry can create the Service
    wait_for("Service created", lambda: kube.get("Service", NS, "retry"), timeout=40)
    assert time.monotonic() - lifted < 40  # the resync is 600 s away
    _wait_ready(kube, "retry")
    _delete(kubectl, "retry")


def test_hpa_on_a_child_is_reported_and_foreign_fields_are_kept(operator, kubectl, kube) -> None:
    kubectl.apply(atomd("scaled", NS, _spec()))
    _wait_ready(kube, "scaled")
    kubectl("autoscale", "deployment", "scaled-unified", "-n", NS, "--name=on-child", "--max=3")
    # the HPA alone changes nothing the operator watches: touch the object to reconcile
    kubectl("annotate", "atomd", "scaled", "-n", NS, "poke=1", "--overwrite")
    obj = _wait_degraded(kube, "scaled", "AutoscalerOnChild")
    assert "kind AtomDeployment" in condition(obj, "Degraded")["message"]
    kubectl("delete", "hpa", "on-child", "-n", NS)
    kubectl("annotate", "atomd", "scaled", "-n", NS, "poke=2", "--overwrite")
    _wait_ready(kube, "scaled")

    # Another manager's env var stays; our managed-by label is taken back.
    foreign = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "scaled-unified", "namespace": NS},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "runtime", "env": [{"name": "SIDECAR_HINT", "value": "1"}]}
                    ]
                }
            }
        },
    }
    # the label first: a Deployment no longer labelled ours is seen through its pods' events
    kubectl(
        "label",
        "deployment",
        "scaled-unified",
        "-n",
        NS,
        "app.kubernetes.io/managed-by=someone",
        "--overwrite",
    )
    kubectl.apply(foreign, "--field-manager=other-tool")

    def settled() -> bool:
        dep = kube.get("Deployment", NS, "scaled-unified")
        env = dep["spec"]["template"]["spec"]["containers"][0]["env"]
        return (
            dep["metadata"]["labels"][naming.LABEL_MANAGED_BY] == naming.MANAGED_BY
            and {"name": "SIDECAR_HINT", "value": "1"} in env
        )

    wait_for("label restored, foreign env var kept", settled, timeout=30)
    _delete(kubectl, "scaled")


def test_host_volume_refused_by_the_operator_without_the_policy(operator, kubectl, kube) -> None:
    spec = _spec(model={"name": "m", "loadFormat": "dummy", "volume": {"hostPath": {"path": "/"}}})
    kubectl.apply(atomd("host", NS, spec))
    obj = _wait_degraded(kube, "host", "HostVolumeForbidden")
    assert "spec.model.volume.hostPath" in condition(obj, "Degraded")["message"]
    assert kube.get("Deployment", NS, "host-unified") is None
    _delete(kubectl, "host")


def test_pdb_spread_and_network_policies_on_the_api_server(operator, kubectl, kube) -> None:
    dis = {"prefill": {"replicas": 1}, "decode": {"replicas": 2}}
    kubectl.apply(atomd("iso", NS, _spec(disaggregation=dis)))
    obj = _wait_ready(kube, "iso")
    selector = naming.instance_selector("iso")
    pdbs = {p["metadata"]["name"]: p for p in kube.list("PodDisruptionBudget", NS, selector)}
    assert set(pdbs) == {"iso-decode", "iso-router"}  # prefill has one pod: no budget
    # the decode budget counts the decode pods of every revision
    wait_for(
        "the decode PDB sees both decode pods",
        lambda: (
            kube.request("GET", f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/iso-decode")
            .get("status", {})
            .get("expectedPods")
            == 2
        ),
        timeout=30,
    )
    pols = {p["metadata"]["name"]: p for p in kube.list("NetworkPolicy", NS, selector)}
    assert set(pols) == {"iso-endpoint", "iso-prefill", "iso-decode"}
    pods = kube.list("Pod", NS, naming.selector_string(naming.selector_labels("iso")))
    for pod in pods:
        labels = pod["metadata"]["labels"]
        hits = [
            n
            for n, p in pols.items()
            if all(labels.get(k) == v for k, v in p["spec"]["podSelector"]["matchLabels"].items())
        ]
        assert len(hits) == 1, (pod["metadata"]["name"], hits)
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False
        assert spec["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "ScheduleAnyway"
    # the internal token exists once and is not rewritten by later reconciles
    secret = kube.get("Secret", NS, "iso-internal-token")
    assert secret is not None and len(secret["data"]["token"]) > 40
    done = _reconciles(operator)
    kubectl("annotate", "atomd", "iso", "-n", NS, "poke=1", "--overwrite")
    wait_for("the reconcile of the poke", lambda: _reconciles(operator) > done, timeout=30)
    assert kube.get("Secret", NS, "iso-internal-token")["data"] == secret["data"]
    assert obj["status"]["roles"]["router"]["replicas"] == 2
    _delete(kubectl, "iso")


def test_phase_events_are_posted_once(operator, kubectl, kube) -> None:
    """Phase changes are posted as Events exactly once each."""
    kubectl.apply(atomd("evt", NS, _spec()))
    _wait_ready(kube, "evt")
    # one more reconcile after Ready, which must not post PhaseReady again
    done = _reconciles(operator)
    kubectl("annotate", "atomd", "evt", "-n", NS, "poke=1", "--overwrite")
    wait_for("the reconcile of the poke", lambda: _reconciles(operator) > done, timeout=30)
    reasons = [e["reason"] for e in _events(kubectl, "evt")]
    assert reasons.count("PhaseReady") == 1, reasons
    _delete(kubectl, "evt")


def test_restricted_pod_security_accepts_every_examples_pods(operator, kubectl) -> None:
    """Every pod the operator would create for the examples is admitted by a namespace that
    enforces the `restricted` Pod Security level."""
    import yaml

    from atom_operator import builders
    from atom_operator.builders import Owner
    from atom_operator.models import AtomDeploymentSpec
    from atom_operator.snapshot import Snapshot

    ns = "atomd-restricted"
    kubectl("create", "namespace", ns, check=False)
    kubectl(
        "label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted", "--overwrite"
    )
    examples = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))
    pods = []
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "AtomDeployment":
                continue
            owner = Owner(name=doc["metadata"]["name"], namespace=ns, uid="u")
            spec = AtomDeploymentSpec.model_validate(doc["spec"])
            for obj in builders.plan(owner, spec, "atom-runtime:e2e", Snapshot()).apply:
                if obj["kind"] in ("Deployment", "Job"):
                    tmpl = obj["spec"]["template"]
                    name = f"{obj['metadata']['name']}-probe"[:63].rstrip("-")
                    pods.append(
                        {
                            "apiVersion": "v1",
                            "kind": "Pod",
                            "metadata": {
                                "name": name,
                                "namespace": ns,
                                "labels": tmpl["metadata"]["labels"],
                            },
                            "spec": tmpl["spec"],
                        }
                    )
    assert pods
    for pod in pods:
        proc = kubectl.apply(pod, "--dry-run=server", check=False)
        assert proc.returncode == 0, f"{pod['metadata']['name']}: {proc.stderr}"
        assert "violate" not in proc.stderr, proc.stderr


def _reconciles(op: OperatorProcess) -> int:
    """From the operator's own /metrics (Kopf caches its /healthz probes for a minute)."""
    import urllib.request

    url = f"http://127.0.0.1:{op.env['ATOM_OPERATOR_METRICS_PORT']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    (value,) = re.findall(r"^atom_operator_reconciles_total (\S+)$", text, re.M)
    return int(float(value))


def test_two_replicas_one_leads_and_the_other_takes_over(kubectl, kube, env, tmp_path) -> None:
    ns = "atomd-ha"
    install_crd(kubectl)
    kubectl("create", "namespace", ns, check=False)
    ops = []
    for who in ("op-a", "op-b"):
        op = OperatorProcess(env, tmp_path, ns)
        op.starts = {"op-a": 10, "op-b": 20}[who]  # separate log files
        op.env.update(
            ATOM_OPERATOR_IDENTITY=who,
            ATOM_OPERATOR_LEASE_NAME="ha",
            ATOM_OPERATOR_LEASE_SECONDS="6",
            ATOM_OPERATOR_RECONCILE_INTERVAL="2",
        )
        op.start()
        ops.append(op)
    try:
        lease = wait_for(
            "a leader",
            lambda: (kube.get("Lease", ns, "ha") or {}).get("spec", {}).get("holderIdentity"),
            timeout=30,
        )
        leader, follower = (ops[0], ops[1]) if lease == "op-a" else (ops[1], ops[0])
        doc = atomd("ha", ns, _spec())
        kubectl.apply(doc)
        wait_for("ha Ready", lambda: is_ready(get(kube, ns, "ha")), timeout=TIMEOUT)
        assert _reconciles(leader) > 0 and _reconciles(follower) == 0
        leader.kill()
        killed = time.monotonic()
        kubectl("patch", "atomd", "ha", "-n", ns, "--type=merge", "-p", '{"spec":{"replicas":2}}')
        wait_for(
            "the follower took over and scaled",
            lambda: (
                lambda o: (
                    o
                    if is_ready(o) and o["status"]["roles"]["unified"]["readyReplicas"] == 2
                    else None
                )
            )(get(kube, ns, "ha")),
            timeout=60,
        )
        assert time.monotonic() - killed < 6 + 2 + 30  # lease, one renew period, the roll
        assert (
            kube.get("Lease", ns, "ha")["spec"]["holderIdentity"]
            == follower.env["ATOM_OPERATOR_IDENTITY"]
        )
        assert _reconciles(follower) > 0
    finally:
        kubectl("delete", "atomd", "ha", "-n", ns, "--wait=true", "--timeout=30s", check=False)
        for op in ops:
            op.stop()


POD_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "podmonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {"kind": "PodMonitor", "plural": "podmonitors", "singular": "podmonitor"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def test_monitoring_without_the_crd_is_a_condition_then_a_pod_monitor(
    operator, kubectl, kube
) -> None:
    kubectl.apply(atomd("mon", NS, _spec(monitoring={"enabled": True})))
    obj = _wait_ready(kube, "mon")  # no crash loop, no Degraded
    mon = condition(obj, "MonitoringReady")
    assert mon["status"] == "False" and mon["reason"] == "PodMonitorCRDMissing", mon
    kubectl.apply(POD_MONITOR_CRD)
    try:
        wait_for(
            "PodMonitor served",
            lambda: kubectl("get", "podmonitors", "-n", NS, check=False).returncode == 0,
            timeout=30,
        )
        kubectl("annotate", "atomd", "mon", "-n", NS, "poke=1", "--overwrite")
        wait_for(
            "MonitoringReady",
            lambda: condition(_obj(kube, "mon"), "MonitoringReady").get("status") == "True",
            timeout=30,
        )
        out = kubectl("get", "podmonitors", "mon-metrics", "-n", NS, "-o", "json").stdout
        assert json.loads(out)["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"
    finally:
        _delete(kubectl, "mon")
        kubectl("delete", "crd", POD_MONITOR_CRD["metadata"]["name"], "--wait=false", check=False)
