"""spec.device: cpu renders `--device cpu`, graph mode NONE, no GPU request, its own cache key."""

from __future__ import annotations

import pytest
from atomd_helpers import IMAGE, spec

from atom.cli.args import build_parser
from atom_operator import models, naming, runtime_args
from atom_operator.builders.runtime import role_resources, runtime_container


def test_cpu_renders_device_and_no_graphs_for_every_role() -> None:
    for name in ("unified", "disaggregated"):
        s = spec(name, device="cpu")
        for role in runtime_args.roles(s):
            ns = build_parser().parse_args(runtime_args.render_args(s, role, cache_dir=None))
            assert ns.device == "cpu"
            # unset (and decode's FULL_DECODE_ONLY default) resolve to NONE on cpu
            assert ns.cudagraph_mode == "NONE"
            assert ns.cudagraph_capture_sizes is None and ns.cuda_graph_sizes is None
            comp = runtime_args.effective_compilation(s, role)
            assert runtime_args.capture_sizes(s, comp) == []


def test_gpu_is_the_default_and_renders_no_device_flag() -> None:
    s = spec("unified")
    assert s.device == "gpu"
    ns = build_parser().parse_args(runtime_args.render_args(s, naming.UNIFIED, cache_dir=None))
    assert ns.device is None
    assert role_resources(s, naming.UNIFIED) == {
        "limits": {"nvidia.com/gpu": 1, "memory": "16Gi"},
        "requests": {"cpu": "2", "memory": "16Gi"},
    }


def test_cpu_requests_no_gpu_even_when_resources_name_one() -> None:
    s = spec("unified", device="cpu")
    assert "nvidia.com/gpu" not in str(role_resources(s, naming.UNIFIED))
    given = {"limits": {"nvidia.com/gpu": 1, "memory": "4Gi"}, "requests": {"cpu": "1"}}
    s = spec("unified", device="cpu", resources=given)
    container = runtime_container("demo", s, naming.UNIFIED, IMAGE, "k")
    assert container["resources"] == {"limits": {"memory": "4Gi"}, "requests": {"cpu": "1"}}


def test_device_is_part_of_the_cache_key() -> None:
    gpu, cpu = spec("unified"), spec("unified", device="cpu")
    assert runtime_args.cache_key(gpu, naming.UNIFIED, IMAGE) != runtime_args.cache_key(
        cpu, naming.UNIFIED, IMAGE
    )


@pytest.mark.parametrize(
    "path",
    ["compilation", "disaggregation.prefill.compilation", "disaggregation.decode.compilation"],
)
def test_cel_refuses_graph_modes_on_cpu(path: str) -> None:
    rules = [
        r
        for r in models.AtomDeploymentSpec.model_json_schema()["x-kubernetes-validations"]
        if r["fieldPath"] == f".{path}.cudagraphMode"
    ]
    assert len(rules) == 1 and "self.device == 'cpu'" in rules[0]["rule"]
    assert rules[0]["rule"].endswith(f"self.{path}.cudagraphMode == 'NONE'")
