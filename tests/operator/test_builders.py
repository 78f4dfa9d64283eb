"""Builders against golden manifests (regenerate with UPDATE_GOLDEN=1 after an intended change),
plus the properties every child must have whatever the golden says."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from atomd_helpers import IMAGE, OWNER, SPECS, spec

from atom_operator import builders, naming
from atom_operator.snapshot import Snapshot

GOLDEN = Path(__file__).parent / "golden"
REQUIRED_LABELS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
    "app.kubernetes.io/managed-by",
}


def manifests(name: str) -> list[dict[str, Any]]:
    return builders.plan(OWNER, spec(name), IMAGE, Snapshot()).apply


@pytest.mark.parametrize("name", sorted(SPECS))
def test_matches_golden(name: str) -> None:
    path = GOLDEN / f"{name}.yaml"
    text = yaml.safe_dump_all(manifests(name), sort_keys=True)
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"missing golden {path}: run with UPDATE_GOLDEN=1"
    assert list(yaml.safe_load_all(path.read_text())) == list(yaml.safe_load_all(text))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_children_carry_labels_and_owner(name: str) -> None:
    s = spec(name)
    for obj in manifests(name):
        labels = obj["metadata"]["labels"]
        assert REQUIRED_LABELS <= labels.keys(), obj["metadata"]["name"]
        assert labels["app.kubernetes.io/instance"] == OWNER.name
        refs = obj["metadata"].get("ownerReferences", [])
        if obj["kind"] == "PersistentVolumeClaim":
            assert bool(refs) == (not s.compile_cache.retain_on_delete)
        else:
            assert refs and refs[0]["uid"] == OWNER.uid and refs[0]["controller"] is True


def _runtime_deployments(name: str) -> list[dict[str, Any]]:
    return [
        o
        for o in manifests(name)
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "runtime"
    ]


@pytest.mark.parametrize("name", ["unified", "disaggregated", "custom-sizes"])
def test_runtime_pods_are_safe_and_probed(name: str) -> None:
    deps = _runtime_deployments(name)
    assert deps
    for dep in deps:
        assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        tmpl = dep["spec"]["template"]
        assert tmpl["metadata"]["labels"][naming.LABEL_REVISION]
        pod = tmpl["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        c = pod["containers"][0]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert "nvidia.com/gpu" in c["resources"]["limits"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= tmpl["metadata"]["labels"].items()


def test_cache_dir_is_mount_plus_key() -> None:
    p = builders.plan(OWNER, spec("unified"), IMAGE, Snapshot())
    (dep,) = [o for o in p.apply if o["kind"] == "Deployment"]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        args[args.index("--compile-cache-dir") + 1]
        == f"{naming.CACHE_MOUNT}/{p.cache_keys['unified']}"
    )
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["compile-cache"]["persistentVolumeClaim"]["claimName"] == "demo-compile-cache"


def test_existing_claim_is_used_and_not_created() -> None:
    objs = manifests("full-decode-only")
    assert not [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    job = next(o for o in objs if o["kind"] == "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][0] == "warmup"
    vols = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert vols["compile-cache"]["persistentVolumeClaim"]["claimName"] == "shared-cache"


def test_disaggregated_has_router_and_per_revision_services() -> None:
    p = builders.plan(OWNER, spec("disaggregated"), IMAGE, Snapshot())
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in p.apply)
    rev = p.revision
    assert ("Deployment", "demo-router") in kinds
    assert ("Service", f"demo-prefill-{rev}") in kinds and (
        "Service",
        f"demo-decode-{rev}",
    ) in kinds
    router = next(o for o in p.apply if o["metadata"]["name"] == "demo-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    # DNS names of headless Services: the router resolves them to the revision's pods
    assert args[args.index("--prefill") + 1] == f"demo-prefill-{rev}.serving.svc:8000"
    assert args[args.index("--decode") + 1] == f"demo-decode-{rev}.serving.svc:8000"
    # the router's own parser accepts them, as DNS names to resolve
    from atom.router.main import build_parser
    from atom.router.pool import parse_target

    parsed = build_parser().parse_args(args)
    assert parse_target(parsed.prefill[0]) == (None, f"demo-prefill-{rev}.serving.svc", 8000)
    for role in ("prefill", "decode"):
        objs = {o["kind"]: o for o in p.apply if o["metadata"]["name"] == f"demo-{role}-{rev}"}
        assert objs["Service"]["spec"]["clusterIP"] == "None"
        container = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
        pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        assert pod_ip in container["env"]
        args = container["args"]
        assert args[args.index("--kv-host") + 1] == "$(POD_IP)"
    endpoint = next(
        o for o in p.apply if o["kind"] == "Service" and o["metadata"]["name"] == "demo"
    )
    assert endpoint["spec"]["selector"][naming.LABEL_ROLE] == "router"


def test_long_names_stay_valid() -> None:
    from atom_operator.builders import Owner

    owner = Owner(name="x" * 60, namespace="ns", uid="u")
    for obj in builders.plan(owner, spec("disaggregated"), IMAGE, Snapshot()).apply:
        assert len(obj["metadata"]["name"]) <= 63


def _pods(name: str, **changes: Any) -> dict[str, dict[str, Any]]:
    """Pod specs by role (router included) of a plan over a fresh cluster."""
    objs = builders.plan(OWNER, spec(name, **changes), IMAGE, Snapshot()).apply
    return {
        o["spec"]["template"]["metadata"]["labels"][naming.LABEL_ROLE]: o["spec"]["template"][
            "spec"
        ]
        for o in objs
        if o["kind"] == "Deployment"
    }


def _env(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in pod["containers"][0]["env"]}


def test_token_reaches_router_and_roles_not_unified() -> None:
    p = builders.plan(OWNER, spec("disaggregated"), IMAGE, Snapshot())
    assert p.token_secret == "demo-internal-token"
    ref = {"secretKeyRef": {"name": "demo-internal-token", "key": "token"}}
    for role, pod in _pods("disaggregated").items():
        assert _env(pod)["ATOM_INTERNAL_TOKEN"]["valueFrom"] == ref, role
    assert "ATOM_INTERNAL_TOKEN" not in _env(_pods("unified")["unified"])
    assert builders.plan(OWNER, spec("unified"), IMAGE, Snapshot()).token_secret is None


def test_token_secret_is_random_once_and_owned() -> None:
    from atom_operator.builders.secret import build_internal_token_secret

    obj = build_internal_token_secret(OWNER, "demo-internal-token", "ab" * 32)
    assert obj["stringData"] == {"token": "ab" * 32}
    assert obj["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid


def test_api_key_secret_reaches_runtime_and_router() -> None:
    ref = {"name": "keys", "key": "openai"}
    for name in ("unified", "disaggregated"):
        for role, pod in _pods(name, apiKeySecretRef=ref).items():
            assert _env(pod)["ATOM_API_KEY"]["valueFrom"] == {"secretKeyRef": ref}, role
    assert "ATOM_API_KEY" not in _env(_pods("unified")["unified"])


def test_every_pod_is_guaranteed_memory_and_has_no_token_mounted() -> None:
    for name in sorted(SPECS):
        for role, pod in _pods(name).items():
            res = pod["containers"][0]["resources"]
            assert res["requests"]["cpu"] and res["requests"]["memory"], (name, role)
            assert res["limits"]["memory"] == res["requests"]["memory"], (name, role)
            assert pod["automountServiceAccountToken"] is False
    # a role's own memory request becomes its limit; a GPU-only override keeps the defaults
    custom = _pods("custom-sizes")["unified"]["containers"][0]["resources"]
    assert custom["limits"]["nvidia.com/gpu"] == 2 and custom["requests"]["memory"] == "16Gi"
    own = _pods("unified", resources={"requests": {"memory": "40Gi"}})["unified"]
    assert own["containers"][0]["resources"]["limits"]["memory"] == "40Gi"


def test_probes_lifecycle_and_grace_match_the_runtime_drain() -> None:
    pod = _pods("unified")["unified"]
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] == 5
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 10
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "2Gi"}
    sized = _pods("unified", shmSize="8Gi")["unified"]
    assert (
        next(v for v in sized["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "8Gi"
    )


def test_router_is_read_only_with_scratch_and_two_replicas() -> None:
    p = builders.plan(
        OWNER,
        spec("disaggregated", disaggregation={"prefill": {}, "decode": {}}),
        IMAGE,
        Snapshot(),
    )
    router = next(o for o in p.apply if o["metadata"]["name"] == "demo-router")
    assert router["spec"]["replicas"] == 2
    pod = router["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["livenessProbe"]["tcpSocket"]["port"] == "http"
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert c["resources"]["limits"]["memory"]


def test_priority_runtime_class_and_spread() -> None:
    pods = _pods("disaggregated", priorityClassName="serving", runtimeClassName="nvidia")
    for role, pod in pods.items():
        assert pod["priorityClassName"] == "serving"
        assert ("runtimeClassName" in pod) == (role != "router")
        (tsc,) = pod["topologySpreadConstraints"]
        assert tsc["whenUnsatisfiable"] == "ScheduleAnyway"
        assert tsc["topologyKey"] == "kubernetes.io/hostname"
        assert tsc["labelSelector"]["matchLabels"][naming.LABEL_ROLE] == role
        assert naming.LABEL_REVISION not in tsc["labelSelector"]["matchLabels"]
    assert (
        _pods("unified", topologySpreadConstraints=[])["unified"]["topologySpreadConstraints"] == []
    )


def _kind(name: str, kind: str, **changes: Any) -> dict[str, dict[str, Any]]:
    objs = builders.plan(OWNER, spec(name, **changes), IMAGE, Snapshot()).apply
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def test_disruption_budgets_only_for_roles_with_two_or_more_pods() -> None:
    pdbs = _kind("disaggregated", "PodDisruptionBudget")
    # prefill 1 (none), decode 2, router 1 in this spec
    assert set(pdbs) == {"demo-decode"}
    pdb = pdbs["demo-decode"]["spec"]
    assert pdb["maxUnavailable"] == 1 and pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # no revision label: old and new revisions count together during a rollout
    assert pdb["selector"]["matchLabels"] == naming.selector_labels("demo", "decode")
    assert set(_kind("unified", "PodDisruptionBudget")) == {"demo-unified"}
    assert _kind("unified", "PodDisruptionBudget", replicas=1) == {}


def _selects(policy: dict[str, Any], labels: dict[str, str]) -> bool:
    want = policy["spec"]["podSelector"]["matchLabels"]
    return all(labels.get(k) == v for k, v in want.items())


def test_network_policies_isolate_kv_and_role_ports() -> None:
    pols = _kind("disaggregated", "NetworkPolicy")
    assert set(pols) == {"demo-endpoint", "demo-prefill", "demo-decode"}
    rev = "r"
    pod_labels = {r: naming.labels("demo", "runtime", r, rev) for r in ("prefill", "decode")}
    pod_labels["router"] = naming.labels("demo", "router", "router", rev)
    # each pod is selected by exactly one policy
    for role, labels in pod_labels.items():
        assert [n for n, p in pols.items() if _selects(p, labels)] == [
            {"router": "demo-endpoint"}.get(role, f"demo-{role}")
        ]
    def peer(role: str) -> list[dict]:
        return [{"podSelector": {"matchLabels": naming.selector_labels("demo", role)}}]

    def ingress(p: dict) -> dict:
        return {r["ports"][0].get("port", "any"): r["from"] for r in p["spec"]["ingress"]}

    def with_transport(mode: str) -> dict:
        disagg = {**SPECS["disaggregated"]["disaggregation"], "kvTransport": mode}
        return _kind("disaggregated", "NetworkPolicy", disaggregation=disagg)

    # tcp: the KV port only, from decode pods; decode pods take no traffic from prefill pods
    tcp = with_transport("tcp")
    assert ingress(tcp["demo-prefill"]) == {8000: peer("router"), 8001: peer("decode")}
    assert ingress(tcp["demo-decode"]) == {8000: peer("router")}
    # auto (the default) and nccl: nccl's store and bootstrap use ephemeral ports both ways
    for mode in ("auto", "nccl"):
        got = with_transport(mode)
        assert ingress(got["demo-prefill"]) == {8000: peer("router"), "any": peer("decode")}
        assert ingress(got["demo-decode"]) == {8000: peer("router"), "any": peer("prefill")}
    assert ingress(pols["demo-decode"]) == ingress(got["demo-decode"])
    assert pols["demo-endpoint"]["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {}}]
    # the endpoint's clients and a scraper come from the spec
    only = [{"namespaceSelector": {"matchLabels": {"team": "a"}}}]
    prom = [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
    pols = _kind(
        "disaggregated", "NetworkPolicy", networkPolicy={"endpointFrom": only, "metricsFrom": prom}
    )
    assert pols["demo-endpoint"]["spec"]["ingress"][0]["from"] == only
    assert prom[0] in pols["demo-decode"]["spec"]["ingress"][0]["from"]
    assert _kind("unified", "NetworkPolicy", networkPolicy={"enabled": False}) == {}
    (uni,) = _kind("unified", "NetworkPolicy").values()
    assert uni["spec"]["podSelector"]["matchLabels"][naming.LABEL_ROLE] == "unified"
