"""The CRD's tensor-parallel and KV-transport rules, evaluated by a real API server (the local
control plane: `hack/controlplane install`). Server-side dry runs: nothing is stored, no
operator runs. Each refusal must name the field; each accepted spec must stay accepted. Last,
the rendered P/D Deployments on the real scheduler: decode pods beside their prefill pod."""

from __future__ import annotations

import copy
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from cel_cases import ACCEPTED, BASE, GPU, REFUSED

from atom_devtools.devcluster.crds import wait_crd_established
from atom_operator import builders, crdgen, models, naming
from atom_operator.builders import Owner
from atom_operator.models import AtomDeploymentSpec
from atom_operator.snapshot import Snapshot

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DISAGG: dict[str, Any] = {"disaggregation": {"prefill": {}, "decode": {}}}


def _atomd(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": f"{models.GROUP}/{models.VERSION}",
        "kind": models.KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


@pytest.fixture(scope="module")
def api(cluster) -> Iterator[tuple[Any, str]]:
    """The cluster with this checkout's CRD installed, and a namespace to dry-run into."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crdgen.CRD_PATH))
    name = f"{models.PLURAL}.{models.GROUP}"
    wait_crd_established(cluster.kubectl, name)
    namespace = f"cel-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", namespace)
    yield cluster, namespace
    cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def dry_run(api: tuple[Any, str], spec: dict[str, Any], name: str = "cel"):
    cluster, namespace = api
    doc = json.dumps(_atomd(name, namespace, spec))
    return cluster.kubectl(
        "apply", "--dry-run=server", "-o", "json", "-f", "-", input=doc, check=False
    )


def merged(change: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec.update(copy.deepcopy(change))
    return spec


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refused_naming_the_field(api, case: str) -> None:
    change, field, words = REFUSED[case]
    proc = dry_run(api, merged(change))
    assert proc.returncode != 0, f"{case}: accepted"
    assert field in proc.stderr and words in proc.stderr, f"{case}: {proc.stderr}"


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_accepted(api, case: str) -> None:
    proc = dry_run(api, merged(ACCEPTED[case]))
    assert proc.returncode == 0, f"{case}: {proc.stderr}"


def test_server_defaults(api) -> None:
    proc = dry_run(api, merged(DISAGG))
    assert proc.returncode == 0, proc.stderr
    spec = json.loads(proc.stdout)["spec"]
    assert spec["parallelism"] == {}  # present (so CEL can read it), size unset
    assert spec["disaggregation"]["kvTransport"] == "auto"


def test_every_example_is_accepted(api) -> None:
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == models.KIND:
                proc = dry_run(api, doc["spec"], doc["metadata"]["name"])
                assert proc.returncode == 0, f"{path.name}: {proc.stderr}"


def test_scheduler_puts_decode_pods_beside_their_prefill_pod(api) -> None:
    """The rendered Deployments on the real scheduler (two 8-GPU kwok nodes): with nccl all
    three decode pods join the one prefill pod's node, although their soft spread alone would
    use both nodes; the API server keeps matchLabelKeys and adds the revision to the pods'
    selector."""
    cluster, namespace = api
    s = AtomDeploymentSpec.model_validate(
        merged(
            {
                "compileCache": {"enabled": False},  # no claim to bind: only placement counts
                "disaggregation": {
                    "prefill": {"replicas": 1, "parallelism": {"tensor": 2}},
                    "decode": {"replicas": 3},
                    "kvTransport": "nccl",
                },
            }
        )
    )
    owner = Owner(name="pair", namespace=namespace, uid="not-stored")
    plan = builders.plan(owner, s, "registry.example/atom-runtime:1", Snapshot())
    deployments = []
    for obj in plan.apply:
        if obj["kind"] == "Deployment" and obj["metadata"]["labels"][naming.LABEL_ROLE] in (
            naming.PREFILL,
            naming.DECODE,
        ):
            obj = copy.deepcopy(obj)
            del obj["metadata"]["ownerReferences"]  # no owner stored: GC would delete them
            deployments.append(obj)
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"kind": "List", "apiVersion": "v1",
                                                          "items": deployments}))  # fmt: skip
    selector = f"{naming.LABEL_INSTANCE}=pair"

    def placed() -> list[dict[str, Any]] | None:
        out = cluster.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json")
        pods = json.loads(out.stdout)["items"]
        done = len(pods) == 4 and all(p["spec"].get("nodeName") for p in pods)
        return pods if done else None

    deadline = time.monotonic() + 60
    while (pods := placed()) is None:
        assert time.monotonic() < deadline, "pods not scheduled within 60 s"
        time.sleep(0.5)
    nodes = {
        role: sorted(
            p["spec"]["nodeName"]
            for p in pods
            if p["metadata"]["labels"][naming.LABEL_ROLE] == role
        )
        for role in (naming.PREFILL, naming.DECODE)
    }
    assert len(nodes[naming.PREFILL]) == 1 and nodes[naming.DECODE] == nodes[naming.PREFILL] * 3
    decode = next(p for p in pods if p["metadata"]["labels"][naming.LABEL_ROLE] == naming.DECODE)
    (term,) = decode["spec"]["affinity"]["podAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["matchLabelKeys"] == [naming.LABEL_REVISION]
    assert {"key": naming.LABEL_REVISION, "operator": "In", "values": [plan.revision]} in term[
        "labelSelector"
    ].get("matchExpressions", [])
    prefill = next(p for p in pods if p["metadata"]["labels"][naming.LABEL_ROLE] == naming.PREFILL)
    assert prefill["spec"]["containers"][0]["resources"]["limits"][GPU] == "2"
