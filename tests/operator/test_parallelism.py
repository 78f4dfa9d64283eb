"""spec.parallelism.tensor (and per P/D role): the runtime flag, the GPU request, the
compile-cache key, the status and the CRD's shape. The CEL rules themselves run against the
API server in test_parallelism_cel.py."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from atomd_helpers import IMAGE, OWNER, SPECS, spec

from atom.cli.args import build_parser
from atom_operator import builders, crdgen, naming, runtime_args
from atom_operator.builders.runtime import role_resources
from atom_operator.models import AtomDeploymentSpec
from atom_operator.snapshot import Snapshot
from atom_operator.status import compute_status

GPU = "nvidia.com/gpu"
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def disagg(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, **top):
    body = dict(SPECS["disaggregated"])
    body["disaggregation"] = {
        "prefill": {"replicas": 1, **(prefill or {})},
        "decode": {"replicas": 2, **(decode or {})},
    }
    return spec({**body, **top})


def parsed(s, role: str):
    return build_parser().parse_args(runtime_args.render_args(s, role, cache_dir=None))


def gpus(s, role: str) -> Any:
    return role_resources(s, role)["limits"].get(GPU)


def test_tensor_size_reaches_the_flag_and_the_gpu_request() -> None:
    s = spec("unified", parallelism={"tensor": 4})
    assert parsed(s, naming.UNIFIED).tensor_parallel_size == 4
    assert gpus(s, naming.UNIFIED) == 4
    plan = builders.plan(OWNER, s, IMAGE, Snapshot())
    dep = next(o for o in plan.apply if o["kind"] == "Deployment")
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"][GPU] == 4
    assert container["args"][container["args"].index("--tensor-parallel-size") + 1] == "4"


def test_unset_is_one_and_renders_no_flag() -> None:
    for s in (spec("unified"), spec("unified", parallelism={"tensor": 1})):
        args = runtime_args.render_args(s, naming.UNIFIED, cache_dir=None)
        assert "--tensor-parallel-size" not in args  # existing pods keep their arguments
        assert parsed(s, naming.UNIFIED).tensor_parallel_size == 1
        assert gpus(s, naming.UNIFIED) == 1


def test_explicit_gpu_count_is_kept() -> None:
    # CEL refuses a count that differs from an explicit tensor size; the operator never
    # overrides what the user wrote (in limits or requests).
    given = {"limits": {GPU: "2", "memory": "8Gi"}}
    s = spec("unified", parallelism={"tensor": 2}, resources=given)
    assert gpus(s, naming.UNIFIED) == "2"
    only_request = {"requests": {GPU: 2}, "limits": {GPU: 2}}
    s = spec("unified", parallelism={"tensor": 2}, resources=only_request)
    assert role_resources(s, naming.UNIFIED)["requests"][GPU] == 2
    # resources without a GPU count: the tensor size is added, the rest is kept
    s = spec("unified", parallelism={"tensor": 8}, resources={"limits": {"memory": "64Gi"}})
    assert role_resources(s, naming.UNIFIED)["limits"] == {"memory": "64Gi", GPU: 8}


def test_roles_override_the_shared_size() -> None:
    s = disagg(decode={"parallelism": {"tensor": 2}}, parallelism={"tensor": 4})
    assert runtime_args.tensor_size(s, naming.PREFILL) == 4
    assert runtime_args.tensor_size(s, naming.DECODE) == 2
    assert parsed(s, naming.PREFILL).tensor_parallel_size == 4
    assert parsed(s, naming.DECODE).tensor_parallel_size == 2
    assert (gpus(s, naming.PREFILL), gpus(s, naming.DECODE)) == (4, 2)
    # a role's parallelism without tensor inherits the shared one
    s = disagg(prefill={"parallelism": {}}, parallelism={"tensor": 2})
    assert runtime_args.tensor_size(s, naming.PREFILL) == 2


def test_cpu_allows_tensor_parallel_without_gpus() -> None:
    s = spec("unified", device="cpu", parallelism={"tensor": 2})
    ns = parsed(s, naming.UNIFIED)
    assert ns.tensor_parallel_size == 2 and ns.device == "cpu"
    assert GPU not in str(role_resources(s, naming.UNIFIED))


def key(s, role: str = naming.UNIFIED) -> str:
    return runtime_args.cache_key(s, role, IMAGE)


def test_cache_key_follows_the_tensor_size_per_role() -> None:
    one, two, four = (spec("unified", parallelism={"tensor": n}) for n in (1, 2, 4))
    assert key(spec("unified")) == key(one)  # unset == 1: keys from before the field stay
    assert len({key(one), key(two), key(four)}) == 3
    # replicas of one size share a key
    assert key(spec("unified", replicas=5, parallelism={"tensor": 2})) == key(two)
    s = disagg(decode={"parallelism": {"tensor": 2}})
    base = disagg()
    assert key(s, naming.PREFILL) == key(base, naming.PREFILL)
    assert key(s, naming.DECODE) != key(base, naming.DECODE)


def test_status_shows_the_size() -> None:
    def status(s) -> dict[str, Any]:
        plan = builders.plan(OWNER, s, IMAGE, Snapshot())
        return compute_status(
            name=OWNER.name, spec=s, generation=1, snap=Snapshot(), plan=plan, now=NOW
        )

    st = status(spec("unified", parallelism={"tensor": 2}))
    assert st["tensorParallel"] == "2" and st["roles"]["unified"]["tensorParallel"] == 2
    st = status(disagg(decode={"parallelism": {"tensor": 2}}, parallelism={"tensor": 4}))
    assert st["tensorParallel"] == "prefill=4,decode=2"
    assert st["roles"]["decode"]["tensorParallel"] == 2
    assert "tensorParallel" not in st["roles"]["router"]


def test_crd_shape_column_and_rules() -> None:
    crd = crdgen.build_crd()
    version = crd["spec"]["versions"][0]
    tp = next(c for c in version["additionalPrinterColumns"] if c["name"] == "TP")
    assert tp["jsonPath"] == ".status.tensorParallel"
    spec_schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    shared = spec_schema["properties"]["parallelism"]
    tensor = shared["properties"]["tensor"]
    # no default: CEL tells "set" from "unset" (an unset size leaves an explicit GPU count alone)
    assert "default" not in tensor and tensor["maximum"] == 8 and tensor["minimum"] == 1
    assert "nvidia.com/gpu" in tensor["description"]  # kubectl explain
    assert shared["x-kubernetes-validations"][0]["rule"].endswith("in [1, 2, 4, 8]")
    roles = spec_schema["properties"]["disaggregation"]["properties"]
    for role in ("prefill", "decode"):
        assert roles[role]["properties"]["parallelism"]["properties"]["tensor"] == tensor
        limits = roles[role]["properties"]["resources"]["properties"]["limits"]
        assert limits["properties"][GPU]["x-kubernetes-int-or-string"] is True
        assert limits["x-kubernetes-preserve-unknown-fields"] is True  # cpu, memory, ... free
    paths = {r.get("fieldPath") for r in spec_schema["x-kubernetes-validations"]}
    assert {
        ".parallelism.tensor",
        ".disaggregation.prefill.parallelism",
        ".disaggregation.decode.parallelism",
    } <= paths


@pytest.mark.parametrize("name", sorted(SPECS))
def test_existing_specs_render_as_before(name: str) -> None:
    """No golden spec sets parallelism: none renders the flag or changes its GPU count."""
    s = spec(name)
    for role in runtime_args.roles(s):
        assert "--tensor-parallel-size" not in runtime_args.render_args(s, role, cache_dir=None)
    expected = 2 if name == "custom-sizes" else 1  # custom-sizes names nvidia.com/gpu: 2
    assert {gpus(s, r) for r in runtime_args.roles(s)} == {expected}


def _example(name: str) -> AtomDeploymentSpec:
    path = Path(__file__).resolve().parents[2] / "examples" / name
    (doc,) = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return AtomDeploymentSpec.model_validate(doc["spec"])


def test_tensor_parallel_example_renders_what_it_says() -> None:
    s = _example("tensor-parallel.yaml")
    assert parsed(s, naming.UNIFIED).tensor_parallel_size == 2
    assert role_resources(s, naming.UNIFIED)["limits"] == {GPU: 2, "memory": "48Gi"}


def test_co_located_example_requires_one_node_per_pair() -> None:
    s = _example("disaggregated-co-located.yaml")
    plan = builders.plan(OWNER, s, IMAGE, Snapshot())
    decode = next(
        o
        for o in plan.apply
        if o["kind"] == "Deployment" and o["metadata"]["labels"][naming.LABEL_ROLE] == "decode"
    )
    affinity = decode["spec"]["template"]["spec"]["affinity"]["podAffinity"]
    assert list(affinity) == ["requiredDuringSchedulingIgnoredDuringExecution"]
    assert parsed(s, naming.PREFILL).kv_transport == "cuda-ipc"
    assert {gpus(s, r) for r in runtime_args.roles(s)} == {1}
