"""The operator against the local control plane (real API server, kwok nodes), driven by kubectl.

kwok marks pods Ready without running containers, so readiness here is the controllers' and
the operator's logic, not the runtime's /health (covered by the runtime's own tests).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from atomd_e2e import (
    Kubectl,
    OperatorProcess,
    atomd,
    condition,
    dump,
    get,
    is_ready,
    pre_bound_pv,
    running_operator,
)

from atom_operator import naming
from atom_operator.kube import Kube
from testutil import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "atomd-e2e"
SC = "atomd-e2e-manual"
READY_TIMEOUT = 90


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, env: dict[str, str], tmp_path_factory) -> Iterator[OperatorProcess]:
    with running_operator(kubectl, env, tmp_path_factory.mktemp("operator"), NS) as op:
        yield op


def _spec(**extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny-llama", "loadFormat": "dummy"},
        "engine": {"maxNumSeqs": 16},
        "compilation": {
            "level": 3,
            "cudagraphMode": "TR_HYBRID",
            "cudagraphCaptureSizes": [1, 2, 4],
        },
        "compileCache": {"storageClassName": SC, "size": "1Gi"},
    }
    spec.update(extra)
    return spec


def _create(kubectl: Kubectl, name: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    claim = naming.pvc_name(name)
    kubectl.apply(pre_bound_pv(f"{NS}-{name}", NS, claim, SC, tmp))
    manifest = atomd(name, NS, spec)
    kubectl.apply(manifest)
    return manifest


def _children(kube: Kube, name: str, kind: str) -> list[dict[str, Any]]:
    return kube.list(kind, NS, naming.instance_selector(name))


def _wait_ready(kube: Kube, name: str, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
    return wait_for(
        f"{name} Ready",
        lambda: (lambda o: o if is_ready(o) else None)(get(kube, NS, name)),
        timeout=timeout,
    )


def test_children_created_and_status_ready(operator, kubectl, kube, tmp_path) -> None:
    _create(kubectl, "uni", _spec(replicas=2), tmp_path)
    obj = _wait_ready(kube, "uni")
    st = obj["status"]
    assert st["roles"]["unified"]["replicas"] == 2 and st["roles"]["unified"]["readyReplicas"] == 2
    assert st["roles"]["unified"]["updatedReplicas"] == 2
    assert condition(obj, "CompileCacheReady")["status"] == "True"
    assert condition(obj, "Degraded")["status"] == "False"
    assert (
        st["endpoint"] == f"http://uni.{NS}.svc:8000"
        and st["compileCache"]["claimName"] == "uni-compile-cache"
    )
    names = {
        (o["kind"], o["metadata"]["name"])
        for k in ("Deployment", "Service", "ConfigMap", "PersistentVolumeClaim")
        for o in _children(kube, "uni", k)
    }
    assert {
        ("Deployment", "uni-unified"),
        ("Service", "uni"),
        ("ConfigMap", "uni-runtime"),
        ("PersistentVolumeClaim", "uni-compile-cache"),
    } <= names
    pods = kube.list("Pod", NS, naming.selector_string(naming.selector_labels("uni", "unified")))
    assert len(pods) == 2 and all(
        p["metadata"]["labels"][naming.LABEL_REVISION] == st["revision"] for p in pods
    )
    out = kubectl("get", "atomd", "uni", "-n", NS).stdout
    assert "TR_HYBRID" in out and "Ready" in out and "1/1" in out


def test_same_manifest_applied_twice_changes_nothing(operator, kubectl, kube) -> None:
    before = _wait_ready(kube, "uni")
    dep_before = kube.get("Deployment", NS, "uni-unified")
    manifest = atomd("uni", NS, _spec(replicas=2))
    kubectl.apply(manifest)
    kubectl.apply(manifest)
    # Nothing should happen: watch for one full reconcile period (2 s) plus margin.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        dep = kube.get("Deployment", NS, "uni-unified")
        assert dep["metadata"]["generation"] == dep_before["metadata"]["generation"]
        time.sleep(0.5)
    after = get(kube, NS, "uni")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["status"]["revision"] == before["status"]["revision"]
    dep_after = kube.get("Deployment", NS, "uni-unified")
    assert dep_after["metadata"]["generation"] == dep_before["metadata"]["generation"]
    assert "kopf.zalando.org/last-handled-configuration" not in (
        after["metadata"].get("annotations") or {}
    )


def test_deleted_or_edited_children_are_restored(operator, kubectl, kube) -> None:
    _wait_ready(kube, "uni")
    svc_uid = kube.get("Service", NS, "uni")["metadata"]["uid"]
    kubectl("delete", "service", "uni", "-n", NS)
    kubectl("delete", "configmap", "uni-runtime", "-n", NS)
    kubectl("scale", "deployment", "uni-unified", "-n", NS, "--replicas=5")
    kubectl(
        "patch",
        "deployment",
        "uni-unified",
        "-n",
        NS,
        "--type=json",
        "-p",
        '[{"op":"replace","path":"/spec/template/spec/containers/0/image","value":"hijacked:1"}]',
    )

    def restored() -> bool:
        svc = kube.get("Service", NS, "uni")
        cm = kube.get("ConfigMap", NS, "uni-runtime")
        dep = kube.get("Deployment", NS, "uni-unified")
        return bool(
            svc
            and svc["metadata"]["uid"] != svc_uid
            and cm
            and dep
            and dep["spec"]["replicas"] == 2
            and dep["spec"]["template"]["spec"]["containers"][0]["image"] == "atom-runtime:e2e"
        )

    wait_for("children restored", restored, timeout=30)
    _wait_ready(kube, "uni")


def test_graph_mode_patch_rolls_a_new_revision(operator, kubectl, kube) -> None:
    before = _wait_ready(kube, "uni")
    old_rev, old_key = before["status"]["revision"], before["status"]["compileCache"]["key"]
    pvc_uid = kube.get("PersistentVolumeClaim", NS, "uni-compile-cache")["metadata"]["uid"]
    kubectl(
        "patch",
        "atomd",
        "uni",
        "-n",
        NS,
        "--type=merge",
        "-p",
        '{"spec":{"compilation":{"cudagraphMode":"FULL"}}}',
    )

    seen_progressing = wait_for(
        "Progressing at the new revision",
        lambda: (
            lambda o: (
                o
                if (o.get("status") or {}).get("revision") not in (None, old_rev)
                and condition(o, "Progressing").get("status") == "True"
                else None
            )
        )(get(kube, NS, "uni")),
        timeout=30,
        interval=0.1,
    )
    new_rev = seen_progressing["status"]["revision"]
    after = _wait_ready(kube, "uni")
    assert after["status"]["revision"] == new_rev != old_rev
    assert after["status"]["compileCache"]["key"] != old_key
    assert after["status"]["graphMode"] == "FULL"

    def old_pods_gone() -> bool:
        pods = kube.list(
            "Pod", NS, naming.selector_string(naming.selector_labels("uni", "unified"))
        )
        return bool(pods) and all(
            p["metadata"]["labels"][naming.LABEL_REVISION] == new_rev for p in pods
        )

    wait_for("old-revision pods gone", old_pods_gone, timeout=30)
    assert kube.get("PersistentVolumeClaim", NS, "uni-compile-cache")["metadata"]["uid"] == pvc_uid
    dep = kube.get("Deployment", NS, "uni-unified")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--cudagraph-mode") + 1] == "FULL"
    assert args[args.index("--compile-cache-dir") + 1].endswith(
        after["status"]["compileCache"]["key"]
    )


def test_replicas_only_change_rolls_nothing(operator, kubectl, kube) -> None:
    before = _wait_ready(kube, "uni")
    kubectl("scale", "atomd", "uni", "-n", NS, "--replicas=3")  # the scale subresource
    after = wait_for(
        "3 ready replicas",
        lambda: (
            lambda o: (
                o if is_ready(o) and o["status"]["roles"]["unified"]["readyReplicas"] == 3 else None
            )
        )(get(kube, NS, "uni")),
        timeout=READY_TIMEOUT,
    )
    assert after["status"]["revision"] == before["status"]["revision"]
    pods = kube.list("Pod", NS, naming.selector_string(naming.selector_labels("uni", "unified")))
    assert {p["metadata"]["labels"][naming.LABEL_REVISION] for p in pods} == {
        before["status"]["revision"]
    }


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "level out of range": ({"compilation": {"level": 5}}, "spec.compilation.level"),
    "unknown graph mode": (
        {"compilation": {"cudagraphMode": "PIECEWISE"}},
        "spec.compilation.cudagraphMode",
    ),
    "capture size zero": (
        {"compilation": {"cudagraphCaptureSizes": [0, 1]}},
        "spec.compilation.cudagraphCaptureSizes",
    ),
    "duplicate sizes": (
        {"compilation": {"cudagraphCaptureSizes": [1, 2, 2]}},
        "spec.compilation.cudagraphCaptureSizes",
    ),
    "size above maxNumSeqs": (
        {"engine": {"maxNumSeqs": 8}, "compilation": {"cudagraphCaptureSizes": [1, 16]}},
        "spec.compilation.cudagraphCaptureSizes",
    ),
    "size above default maxNumSeqs": (
        {"compilation": {"cudagraphCaptureSizes": [1024]}},
        "spec.compilation.cudagraphCaptureSizes",
    ),
    "replicas with disaggregation": (
        {"replicas": 1, "disaggregation": {"prefill": {}, "decode": {}}},
        "spec.replicas",
    ),
    "disaggregation without decode": (
        {"disaggregation": {"prefill": {"replicas": 1}}},
        "spec.disaggregation.decode",
    ),
    "negative role replicas": (
        {"disaggregation": {"prefill": {"replicas": -1}, "decode": {}}},
        "spec.disaggregation.prefill.replicas",
    ),
    "decode sizes above maxNumSeqs": (
        {
            "engine": {"maxNumSeqs": 4},
            "disaggregation": {
                "prefill": {},
                "decode": {"compilation": {"cudagraphCaptureSizes": [8]}},
            },
        },
        "spec.disaggregation.decode.compilation.cudagraphCaptureSizes",
    ),
    "negative replicas": ({"replicas": -1}, "spec.replicas"),
    "zero maxNumSeqs": ({"engine": {"maxNumSeqs": 0}}, "spec.engine.maxNumSeqs"),
    "bad load format": ({"model": {"name": "x", "loadFormat": "pickle"}}, "spec.model.loadFormat"),
    "model without name or path": ({"model": {"dtype": "float16"}}, "spec.model"),
    "bad cache size": ({"compileCache": {"size": "lots"}}, "spec.compileCache.size"),
    "bad dtype": ({"model": {"name": "x", "dtype": "int3"}}, "spec.model.dtype"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_manifest_refused_naming_the_field(operator, kubectl, case: str) -> None:
    change, field = BAD[case]
    spec = {"model": {"name": "tiny-llama"}}
    spec.update(copy.deepcopy(change))
    proc = kubectl.apply(atomd("bad", NS, spec), "--dry-run=server", check=False)
    assert proc.returncode != 0, f"{case}: accepted"
    assert field in proc.stderr, f"{case}: message does not name {field}: {proc.stderr}"


def test_missing_model_refused(operator, kubectl) -> None:
    proc = kubectl.apply(atomd("bad", NS, {"replicas": 1}), "--dry-run=server", check=False)
    assert proc.returncode != 0 and "spec.model" in proc.stderr


def test_every_mode_at_every_level_accepted(operator, kubectl) -> None:
    modes = ["NONE", "TR_HYBRID", "FULL", "FULL_DECODE_ONLY", "FULL_AND_TR_HYBRID"]
    docs = [
        atomd(
            f"ok-{lvl}-{m.lower().replace('_', '-')}",
            NS,
            {
                "model": {"name": "tiny-llama"},
                "engine": {"maxNumSeqs": 8},
                "compilation": {
                    "level": lvl,
                    "cudagraphMode": m,
                    "cudagraphCaptureSizes": [1, 2, 8],
                },
            },
        )
        for lvl in range(4)
        for m in modes
    ]
    proc = kubectl.apply(docs, "--dry-run=server", check=False)
    assert proc.returncode == 0, proc.stderr


def test_operator_killed_mid_reconcile_converges_without_duplicates(
    operator, kubectl, kube, tmp_path
) -> None:
    spec = _spec(
        disaggregation={
            "prefill": {"replicas": 1},
            "decode": {"replicas": 2},
            "router": {"replicas": 1},
        }
    )
    _create(kubectl, "pd", spec, tmp_path)
    wait_for(
        "first children of pd",
        lambda: (
            _children(kube, "pd", "Deployment") or _children(kube, "pd", "PersistentVolumeClaim")
        ),
        timeout=30,
        interval=0.05,
    )
    operator.kill()
    operator.start()
    obj = _wait_ready(kube, "pd")
    rev = obj["status"]["revision"]
    deps = sorted(d["metadata"]["name"] for d in _children(kube, "pd", "Deployment"))
    assert deps == sorted([f"pd-decode-{rev}", f"pd-prefill-{rev}", "pd-router"]), deps
    svcs = sorted(s["metadata"]["name"] for s in _children(kube, "pd", "Service"))
    assert svcs == sorted(["pd", f"pd-decode-{rev}", f"pd-prefill-{rev}"]), svcs
    assert len(_children(kube, "pd", "ConfigMap")) == 1
    assert obj["status"]["roles"]["decode"]["readyReplicas"] == 2
    assert obj["status"]["ready"] == "3/3", dump(obj["status"])


def test_disaggregated_roll_moves_router_once_both_roles_are_ready(operator, kubectl, kube) -> None:
    before = _wait_ready(kube, "pd")
    old = before["status"]["revision"]
    kubectl(
        "patch",
        "atomd",
        "pd",
        "-n",
        NS,
        "--type=merge",
        "-p",
        '{"spec":{"compilation":{"cudagraphMode":"FULL"}}}',
    )
    samples: list[tuple[str, str]] = []

    def ready_at_new_revision_checking_router() -> dict[str, Any] | None:
        # Every sample: the router pairs prefill and decode of ONE revision, and it only points
        # at the new revision once both of the new revision's roles are fully ready.
        router = kube.get("Deployment", NS, "pd-router")
        args = router["spec"]["template"]["spec"]["containers"][0]["args"]
        pre, dec = args[args.index("--prefill") + 1], args[args.index("--decode") + 1]
        pre_rev, dec_rev = (
            pre.split("pd-prefill-")[1].split(".")[0],
            dec.split("pd-decode-")[1].split(".")[0],
        )
        assert pre_rev == dec_rev, (pre, dec)
        samples.append((pre_rev, router["metadata"]["annotations"][naming.ANNOTATION_SERVING]))
        if pre_rev != old:
            for role in ("prefill", "decode"):
                dep = kube.get("Deployment", NS, f"pd-{role}-{pre_rev}")
                want = dep["spec"]["replicas"]
                assert dep["status"].get("readyReplicas", 0) >= want, f"router on unready {role}"
        o = get(kube, NS, "pd")
        return o if is_ready(o) and o["status"]["revision"] != old else None

    after = wait_for(
        "pd Ready at a new revision",
        ready_at_new_revision_checking_router,
        timeout=READY_TIMEOUT,
        interval=0.1,
    )
    new = after["status"]["revision"]
    assert samples[0][0] == old and samples[-1][0] == new, samples  # we saw the switch happen
    router = kube.get("Deployment", NS, "pd-router")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert (
        f"pd-prefill-{new}" in args[args.index("--prefill") + 1]
        and f"pd-decode-{new}" in args[args.index("--decode") + 1]
    )
    wait_for(
        "old-revision role Deployments pruned",
        lambda: (
            not [d for d in _children(kube, "pd", "Deployment") if old in d["metadata"]["name"]]
        ),
        timeout=30,
    )


def test_large_spec_does_not_overflow_annotations(operator, kubectl, kube, tmp_path) -> None:
    # Kopf's default diff base would copy this ~280 KiB spec into one annotation (limit 256 KiB).
    env = [{"name": f"BIG_{i}", "value": "x" * 100} for i in range(2600)]
    _create(kubectl, "big", _spec(env=env), tmp_path)
    obj = _wait_ready(kube, "big")
    annotations = obj["metadata"].get("annotations") or {}
    assert sum(len(k) + len(v) for k, v in annotations.items()) < 1024, annotations
    kubectl("delete", "atomd", "big", "-n", NS, "--wait=true", "--timeout=30s")


def test_scale_refused_on_disaggregated(operator, kubectl) -> None:
    proc = kubectl("scale", "atomd", "pd", "-n", NS, "--replicas=2", check=False)
    assert proc.returncode != 0 and "spec.replicas" in proc.stderr


def test_warmup_job_fills_the_cache_before_serving_pods(operator, kubectl, kube, tmp_path) -> None:
    _create(
        kubectl,
        "warm",
        _spec(compileCache={"storageClassName": SC, "size": "1Gi", "warmup": True}),
        tmp_path,
    )
    obj = _wait_ready(kube, "warm")
    assert condition(obj, "CompileCacheReady")["reason"] == "Warm"
    (job,) = _children(kube, "warm", "Job")
    assert job["spec"]["template"]["spec"]["containers"][0]["args"][0] == "warmup"
    done = next(c for c in job["status"]["conditions"] if c["type"] == "Complete")
    dep = kube.get("Deployment", NS, "warm-unified")
    # the serving Deployment was only created once the warm-up Job had completed
    assert dep["metadata"]["creationTimestamp"] >= done["lastTransitionTime"]


def test_delete_collects_children_and_keeps_the_cache(operator, kubectl, kube, tmp_path) -> None:
    _wait_ready(kube, "pd")
    kubectl("delete", "atomd", "pd", "-n", NS, "--wait=true", "--timeout=30s")
    wait_for(
        "children garbage-collected",
        lambda: (
            not _children(kube, "pd", "Deployment")
            and not _children(kube, "pd", "Service")
            and not _children(kube, "pd", "ConfigMap")
        ),
        timeout=60,
    )
    pvc = kube.get("PersistentVolumeClaim", NS, "pd-compile-cache")
    assert pvc is not None and not pvc["metadata"].get("deletionTimestamp")
    assert not pvc["metadata"].get("ownerReferences")

    _create(
        kubectl,
        "gone",
        _spec(compileCache={"storageClassName": SC, "size": "1Gi", "retainOnDelete": False}),
        tmp_path,
    )
    _wait_ready(kube, "gone")
    kubectl("delete", "atomd", "gone", "-n", NS, "--wait=true", "--timeout=30s")
    wait_for(
        "the non-retained claim collected",
        lambda: kube.get("PersistentVolumeClaim", NS, "gone-compile-cache") is None,
        timeout=60,
    )
