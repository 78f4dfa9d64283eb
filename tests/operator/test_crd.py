"""The generated CRD: up to date with the models, structural, and carrying the rules."""

from __future__ import annotations

from typing import Any

import yaml

from atom_operator import crdgen


def _schema() -> dict[str, Any]:
    crd = yaml.safe_load(crdgen.CRD_PATH.read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_file_is_up_to_date() -> None:
    assert crdgen.main(["--check"]) == 0, (
        "crds/atomdeployment.yaml is stale: run python -m atom_operator.crdgen"
    )


def test_check_fails_on_stale_file(tmp_path) -> None:
    stale = tmp_path / "crd.yaml"
    stale.write_text(crdgen.render().replace("atomd", "atomx"))
    assert crdgen.main(["--check", "--out", str(stale)]) == 1
    assert crdgen.main(["--out", str(stale)]) == 0
    assert crdgen.main(["--check", "--out", str(stale)]) == 0


def test_names_subresources_and_columns() -> None:
    crd = yaml.safe_load(crdgen.CRD_PATH.read_text())
    assert crd["metadata"]["name"] == "atomdeployments.atom.dev"
    assert crd["spec"]["names"]["shortNames"] == ["atomd"]
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == [
        "Level", "Mode", "Ready", "Phase", "Reason", "Age", "TP", "Current", "Desired"
    ]
    # -o wide only: TP and the autoscaled replica counts
    assert [c.get("priority", 0) for c in version["additionalPrinterColumns"]][5:] == [0, 1, 1, 1]
    reason = version["additionalPrinterColumns"][4]
    assert reason["jsonPath"] == '.status.conditions[?(@.type=="Degraded")].reason'


def test_every_schema_node_is_structural_and_described() -> None:
    def walk(node: dict[str, Any], path: str) -> None:
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert "anyOf" not in node and "$ref" not in node and "title" not in node, path
        if path.count(".") >= 1 and not path.endswith("[]") and path != "root.metadata":
            assert node.get("description"), f"{path} has no description"
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(_schema(), "root")


def test_enums_defaults_and_list_types() -> None:
    spec = _schema()["properties"]["spec"]
    comp = spec["properties"]["compilation"]["properties"]
    assert comp["level"]["enum"] == [0, 1, 2, 3] and comp["level"]["default"] == 3
    assert comp["cudagraphMode"]["enum"] == [
        "NONE",
        "TR_HYBRID",
        "FULL",
        "FULL_DECODE_ONLY",
        "FULL_AND_TR_HYBRID",
    ]
    sizes = comp["cudagraphCaptureSizes"]
    assert sizes["x-kubernetes-list-type"] == "set" and sizes["items"]["minimum"] == 1
    assert "default" not in spec["properties"]["replicas"], (
        "a default would collide with disaggregation"
    )
    assert spec["properties"]["replicas"]["minimum"] == 0
    dis = spec["properties"]["disaggregation"]
    assert sorted(dis["required"]) == ["decode", "prefill"]
    # a P/D role or router at zero cannot serve: refused, not reported Ready
    for role in ("prefill", "decode", "router"):
        assert dis["properties"][role]["properties"]["replicas"]["minimum"] == 1, role
    assert dis["properties"]["router"]["properties"]["replicas"]["default"] == 2
    cache = spec["properties"]["compileCache"]["properties"]
    assert cache["retainOnDelete"]["default"] is True


def test_cel_rules_cover_cross_field_constraints() -> None:
    rules = {r["rule"]: r for r in _schema()["properties"]["spec"]["x-kubernetes-validations"]}
    assert "!(has(self.replicas) && has(self.disaggregation))" in rules
    # both size lists of the shared, prefill and decode compilation blocks
    assert sum("self.engine.maxNumSeqs" in r for r in rules) == 6
    for block in ("compilation", "disaggregation.prefill.compilation"):
        for field in ("cudagraphCaptureSizes", "cudaGraphSizes"):
            assert any(r["fieldPath"] == f".{block}.{field}" for r in rules.values()), field
    for rule in rules.values():
        assert rule["message"] and rule["fieldPath"].startswith(".")


def test_root_rules_limit_the_name() -> None:
    rules = _schema()["x-kubernetes-validations"]
    text = " ".join(r["rule"] for r in rules)
    assert "size(self.metadata.name) <= 63" in text and "matches(" in text
    assert all("DNS-1035" in r["message"] for r in rules)
