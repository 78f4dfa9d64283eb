"""The CRD's CEL rules, evaluated by cel-python against the CRD's own schema: no cluster.

`violations` does what the API server does with a manifest, as far as CEL goes: it applies the
schema's defaults, then evaluates every `x-kubernetes-validations` rule at the node it sits
on, with `self` bound to that node's value and property names escaped as Kubernetes escapes
them. The cluster test (test_parallelism_cel.py) judges the same cases on a real API server.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import celpy
import pytest
from cel_cases import ACCEPTED, BASE, REFUSED, res

from atom_operator import crd_rules, crdgen

CRD = crdgen.build_crd()
SCHEMA: dict[str, Any] = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
_ENV = celpy.Environment()
_ESCAPES = (("__", "__underscores__"), (".", "__dot__"), ("-", "__dash__"), ("/", "__slash__"))


def escaped(value: Any) -> Any:
    """Property names as CEL sees them in Kubernetes (nvidia.com/gpu: nvidia__dot__com__slash__gpu)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            for plain, escape in _ESCAPES:
                key = key.replace(plain, escape)
            out[key] = escaped(item)
        return out
    if isinstance(value, list):
        return [escaped(item) for item in value]
    return value


# optionalOldSelf's Optional, as a list of zero (a create) or one value: its two methods.
_OPTIONAL = {
    "hasValue": lambda o: celpy.celtypes.BoolType(len(o) > 0),
    "value": lambda o: o[0] if o else celpy.CELEvalError("optional.none() has no value"),
}


@functools.cache
def _program(rule: str) -> celpy.Runner:
    return _ENV.program(_ENV.compile(rule), functions=_OPTIONAL)


def holds(rule: str, value: Any, old: Any = None) -> bool:
    """`rule` on a create (`old` None) or on an update from `old`."""
    olds = [] if old is None else [celpy.json_to_cel(escaped(old))]
    return bool(
        _program(rule).evaluate(
            {"self": celpy.json_to_cel(escaped(value)), "oldSelf": celpy.celtypes.ListType(olds)}
        )
    )


def defaulted(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: a missing property with a default gets it, recursively."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for name, sub in props.items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
        for name, item in value.items():
            if name in props:
                value[name] = defaulted(props[name], item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [defaulted(schema["items"], item) for item in value]
    return value


def _walk(schema: dict[str, Any], value: Any, path: str, out: list[tuple[str, str]]) -> None:
    for rule in schema.get("x-kubernetes-validations", []):
        if not holds(rule["rule"], value):
            out.append((path + rule.get("fieldPath", ""), rule["message"]))
    if isinstance(value, dict):
        for name, item in value.items():
            if name in schema.get("properties", {}):
                _walk(schema["properties"][name], item, f"{path}.{name}".lstrip("."), out)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _walk(schema["items"], item, f"{path}[]", out)


def violations(spec: dict[str, Any], name: str = "cel") -> list[tuple[str, str]]:
    """(field, message) of every CEL rule the AtomDeployment breaks, as the API server names
    them (the rule's node path plus its fieldPath)."""
    obj = {"metadata": {"name": name}, "spec": defaulted(SCHEMA["properties"]["spec"], spec)}
    found: list[tuple[str, str]] = []
    _walk(SCHEMA, obj, "", found)
    return found


def merged(change: dict[str, Any]) -> dict[str, Any]:
    spec = copy.deepcopy(BASE)
    spec.update(copy.deepcopy(change))
    return spec


def _messages(schema: dict[str, Any]) -> list[str]:
    """The message of every CEL rule in the schema."""
    found = [rule["message"] for rule in schema.get("x-kubernetes-validations", [])]
    subs = list(schema.get("properties", {}).values())
    if isinstance(schema.get("items"), dict):
        subs.append(schema["items"])
    return found + [m for sub in subs for m in _messages(sub)]


CEL_MESSAGES = _messages(SCHEMA)
# The refused cases a CEL rule refuses (the others are the schema's bounds and enums).
CEL_REFUSED = {
    case: (change, field, words)
    for case, (change, field, words) in REFUSED.items()
    if any(words in m for m in CEL_MESSAGES)
}


def test_cel_cases_are_most_of_the_refused_ones() -> None:
    assert len(CEL_REFUSED) >= 8, sorted(CEL_REFUSED)


@pytest.mark.parametrize("case", sorted(CEL_REFUSED))
def test_refused_case_breaks_the_rule_that_names_its_field(case: str) -> None:
    change, field, words = CEL_REFUSED[case]
    found = violations(merged(change))
    assert any(f == field and words in m for f, m in found), (case, found)


@pytest.mark.parametrize("case", sorted(ACCEPTED))
def test_accepted_case_breaks_no_rule(case: str) -> None:
    assert violations(merged(ACCEPTED[case])) == []


def test_spec_node_carries_spec_rules_and_root_carries_root_rules() -> None:
    assert SCHEMA["properties"]["spec"]["x-kubernetes-validations"] == crd_rules.spec_rules()
    assert SCHEMA["x-kubernetes-validations"] == crd_rules.root_rules()


def test_every_rule_compiles_and_the_base_spec_breaks_none() -> None:
    for rule in crd_rules.spec_rules() + crd_rules.root_rules():
        _program(rule["rule"])
    assert violations(merged({})) == []


def test_replicas_and_disaggregation_exclude_each_other() -> None:
    both = merged({"replicas": 2, "disaggregation": {"prefill": {}, "decode": {}}})
    assert [f for f, _ in violations(both)] == ["spec.replicas"]
    assert violations(merged({"replicas": 2})) == []


@pytest.mark.parametrize("path", crd_rules.COMPILATION_PATHS)
def test_capture_sizes_are_checked_against_max_num_seqs_at_every_path(path: str) -> None:
    def at(sizes_field: str, sizes: list[int], max_seqs: int | None = None) -> dict[str, Any]:
        leaf: dict[str, Any] = {sizes_field: sizes}
        for part in reversed(path.split(".")):
            leaf = {part: leaf}
        spec = merged(leaf)
        if path.startswith("disaggregation"):
            spec["disaggregation"] = {"prefill": {}, "decode": {}, **spec["disaggregation"]}
        if max_seqs is not None:
            spec["engine"] = {"maxNumSeqs": max_seqs}
        return spec

    default = crd_rules.DEFAULT_MAX_NUM_SEQS
    field = f"spec.{path}.cudagraphCaptureSizes"
    assert [f for f, _ in violations(at("cudagraphCaptureSizes", [1, default + 1]))] == [field]
    assert violations(at("cudagraphCaptureSizes", [1, default])) == []
    assert [f for f, _ in violations(at("cudagraphCaptureSizes", [8, 16], 8))] == [field]
    assert violations(at("cudagraphCaptureSizes", [1, 1024], 1024)) == []
    # one cudaGraphSizes value is a pattern the runtime clamps; several are used as they are
    graph = f"spec.{path}.cudaGraphSizes"
    assert violations(at("cudaGraphSizes", [default * 4])) == []
    assert [f for f, _ in violations(at("cudaGraphSizes", [8, 64], 32))] == [graph]


@pytest.mark.parametrize("path", crd_rules.COMPILATION_PATHS)
def test_cpu_runs_no_graph_mode_at_every_path(path: str) -> None:
    def at(device: str, mode: str) -> dict[str, Any]:
        leaf: dict[str, Any] = {"cudagraphMode": mode}
        for part in reversed(path.split(".")):
            leaf = {part: leaf}
        spec = merged({"device": device, **leaf})
        if path.startswith("disaggregation"):
            spec["disaggregation"] = {"prefill": {}, "decode": {}, **spec["disaggregation"]}
        return spec

    assert [f for f, _ in violations(at("cpu", "FULL"))] == [f"spec.{path}.cudagraphMode"]
    assert violations(at("cpu", "NONE")) == []
    assert violations(at("gpu", "FULL")) == []


def test_gpu_request_alone_must_match_the_tensor_size() -> None:
    refused = merged({"parallelism": {"tensor": 2}, "resources": res(request=1)})
    assert [f for f, _ in violations(refused)] == ["spec.parallelism.tensor"]
    assert violations(merged({"parallelism": {"tensor": 2}, "resources": res(request="2")})) == []


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("a" * crd_rules.MAX_NAME_LENGTH, True),
        ("a" * (crd_rules.MAX_NAME_LENGTH + 1), False),
        ("demo-1", True),
        ("a.b", False),
        ("Demo", False),
        ("1demo", False),
        ("demo-", False),
    ],
)
def test_root_rules_hold_metadata_name_to_dns_1035(name: str, ok: bool) -> None:
    found = violations(merged({}), name=name)
    assert (found == []) is ok, found
    assert all(m.startswith("metadata.name") for _, m in found)
