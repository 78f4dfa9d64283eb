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
        env = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]
        kv_host = {"name": "ATOM_KV_HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        assert kv_host in env
    endpoint = next(
        o for o in p.apply if o["kind"] == "Service" and o["metadata"]["name"] == "demo"
    )
    assert endpoint["spec"]["selector"][naming.LABEL_ROLE] == "router"


def test_long_names_stay_valid() -> None:
    from atom_operator.builders import Owner

    owner = Owner(name="x" * 60, namespace="ns", uid="u")
    for obj in builders.plan(owner, spec("disaggregated"), IMAGE, Snapshot()).apply:
        assert len(obj["metadata"]["name"]) <= 63
