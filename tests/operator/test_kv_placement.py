"""spec.disaggregation.kvTransport: --kv-transport on both roles, and the decode pods' podAffinity
to their revision's prefill pods (required for cuda-ipc/nccl, preferred for auto, none for tcp).
The CEL rule (GPU transports need device gpu) runs against the API server in
test_parallelism_cel.py."""

from __future__ import annotations

from typing import Any

import pytest
from atomd_helpers import IMAGE, OWNER, SPECS, spec

from atom.cli.args import build_parser
from atom_operator import builders, crdgen, models, naming, runtime_args
from atom_operator.snapshot import Snapshot

HOST = "kubernetes.io/hostname"


def disagg(transport: str | None = None, **top: Any):
    body = dict(SPECS["disaggregated"])
    dis = dict(body["disaggregation"])
    if transport is not None:
        dis["kvTransport"] = transport
    return spec({**body, "disaggregation": dis, **top})


def pods(s) -> dict[str, dict[str, Any]]:
    """Serving pod spec per role, from the plan's Deployments."""
    out = {}
    for obj in builders.plan(OWNER, s, IMAGE, Snapshot()).apply:
        if obj["kind"] == "Deployment":
            out[obj["metadata"]["labels"][naming.LABEL_ROLE]] = obj["spec"]["template"]["spec"]
    return out


def prefill_term(instance: str = OWNER.name) -> dict[str, Any]:
    return {
        "labelSelector": {"matchLabels": naming.selector_labels(instance, naming.PREFILL)},
        "matchLabelKeys": [naming.LABEL_REVISION],
        "topologyKey": HOST,
    }


@pytest.mark.parametrize("transport", models.KV_TRANSPORTS)
def test_transport_reaches_both_roles(transport: str) -> None:
    s = disagg(transport)
    for role in (naming.PREFILL, naming.DECODE):
        ns = build_parser().parse_args(runtime_args.render_args(s, role, cache_dir=None))
        assert ns.kv_transport == transport
    assert "--kv-transport" not in runtime_args.render_args(
        spec("unified"), naming.UNIFIED, cache_dir=None
    )


def test_default_is_auto() -> None:
    assert disagg().disaggregation.kv_transport == "auto"
    field = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    kv = field["properties"]["spec"]["properties"]["disaggregation"]["properties"]["kvTransport"]
    assert kv["default"] == "auto" and kv["enum"] == list(models.KV_TRANSPORTS)
    assert "podAffinity" in kv["description"] and "TCP" in kv["description"]


@pytest.mark.parametrize("transport", ["cuda-ipc", "nccl"])
def test_gpu_transports_require_one_node_for_a_pair(transport: str) -> None:
    p = pods(disagg(transport))
    affinity = p[naming.DECODE]["affinity"]["podAffinity"]
    assert affinity == {"requiredDuringSchedulingIgnoredDuringExecution": [prefill_term()]}
    assert "affinity" not in p[naming.PREFILL]  # prefill keeps its spread; decode follows it
    assert "affinity" not in p[naming.ROUTER]


def test_auto_prefers_one_node_and_tcp_places_nothing() -> None:
    auto = pods(disagg("auto"))[naming.DECODE]["affinity"]["podAffinity"]
    assert auto == {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 100, "podAffinityTerm": prefill_term()}
        ]
    }
    assert "affinity" not in pods(disagg("tcp"))[naming.DECODE]


def test_affinity_matches_this_revisions_prefill_pods() -> None:
    p = builders.plan(OWNER, disagg("nccl"), IMAGE, Snapshot())
    deps = {
        o["metadata"]["labels"][naming.LABEL_ROLE]: o for o in p.apply if o["kind"] == "Deployment"
    }
    term = deps[naming.DECODE]["spec"]["template"]["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ][0]
    prefill_labels = deps[naming.PREFILL]["spec"]["template"]["metadata"]["labels"]
    selector = term["labelSelector"]["matchLabels"]
    assert selector.items() <= prefill_labels.items()
    # the revision comes from the decode pod's own label (same value as its prefill pods')
    decode_labels = deps[naming.DECODE]["spec"]["template"]["metadata"]["labels"]
    for key in term["matchLabelKeys"]:
        assert decode_labels[key] == prefill_labels[key] == p.revision
        assert key not in selector  # Kubernetes refuses a key in both


def test_user_affinity_is_kept_and_extended() -> None:
    own = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]}
        ]}},
        "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": "cache"}}, "topologyKey": "zone"}
        ]},
    }  # fmt: skip
    s = disagg("cuda-ipc", affinity=own)
    p = pods(s)
    decode = p[naming.DECODE]["affinity"]
    assert decode["nodeAffinity"] == own["nodeAffinity"]
    required = decode["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert required == [own["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0],
                        prefill_term()]  # fmt: skip
    assert p[naming.PREFILL]["affinity"] == own and p[naming.ROUTER]["affinity"] == own
    assert len(s.affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]) == 1


def test_spread_and_budgets_are_unchanged_by_placement() -> None:
    """The role's soft spread still applies (within the nodes the affinity allows) and the
    budgets stay per role: co-location adds a term, it removes none."""

    def spread_and_pdbs(s) -> tuple[Any, Any]:
        plan = builders.plan(OWNER, s, IMAGE, Snapshot())
        deps = [o for o in plan.apply if o["kind"] == "Deployment"]
        pdbs = [o for o in plan.apply if o["kind"] == "PodDisruptionBudget"]
        spread = {
            d["metadata"]["labels"][naming.LABEL_ROLE]: d["spec"]["template"]["spec"][
                "topologySpreadConstraints"
            ]
            for d in deps
        }
        return spread, [(p["metadata"]["name"], p["spec"]) for p in pdbs]

    tcp = spread_and_pdbs(disagg("tcp"))
    for transport in ("auto", "cuda-ipc", "nccl"):
        assert spread_and_pdbs(disagg(transport)) == tcp, transport


def test_warmup_pods_get_no_co_location() -> None:
    """A warm-up Job runs before any prefill pod exists: a required term would hold it forever."""
    s = disagg("nccl", compileCache={"warmup": True})
    jobs = [o for o in builders.plan(OWNER, s, IMAGE, Snapshot()).apply if o["kind"] == "Job"]
    assert jobs and all("affinity" not in j["spec"]["template"]["spec"] for j in jobs)


def test_transport_is_not_in_the_cache_key() -> None:
    keys = {t: builders.cache_keys(disagg(t), IMAGE) for t in models.KV_TRANSPORTS}
    assert len({tuple(k.items()) for k in keys.values()}) == 1
