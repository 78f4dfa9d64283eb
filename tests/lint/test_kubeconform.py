"""`kubeconform -strict` over every child the operator renders and over the chart, against
JSON schemas made from the local API server's own OpenAPI (v2), not a download.

`hack/controlplane install` builds the pinned kubeconform (versions.KUBECONFORM) from the Go
module proxy into $ATOM_CACHE_DIR/bin.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from rendered import tool, write_chart, write_children

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
# kubeconform's template: one file per kind, group and version.
LOCATION = "{{ .ResourceKind }}_{{ .Group }}_{{ .ResourceAPIVersion }}.json"


def _strict(node: Any) -> Any:
    """OpenAPI v2 definitions as JSON Schema: refs into one _definitions.json, closed objects
    (what -strict checks), int-or-string as either."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if isinstance(out.get("$ref"), str):  # JSONSchemaProps also has a *property* named $ref
        out["$ref"] = "_definitions.json" + out["$ref"]
    if out.pop("format", None) == "int-or-string":
        out.pop("type", None)
        out["oneOf"] = [{"type": "string"}, {"type": "integer"}]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


# v2 says "string" for a Quantity; the API server takes a number too (`nvidia.com/gpu: 1`).
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"


def write_schemas(openapi: dict[str, Any], out: Path) -> int:
    defs = {name: _strict(d) for name, d in openapi["definitions"].items()}
    defs[QUANTITY] = {"oneOf": [{"type": "string"}, {"type": "number"}]}
    (out / "_definitions.json").write_text(json.dumps({"definitions": defs}))
    count = 0
    for name, definition in openapi["definitions"].items():
        for gvk in definition.get("x-kubernetes-group-version-kind") or []:
            file = LOCATION.replace("{{ .ResourceKind }}", gvk["kind"].lower())
            # kubeconform's .Group is the apiVersion's first part: "v1" for the core group
            file = file.replace("{{ .Group }}", gvk["group"] or gvk["version"]).replace(
                "{{ .ResourceAPIVersion }}", gvk["version"]
            )
            (out / file).write_text(json.dumps({"$ref": f"_definitions.json#/definitions/{name}"}))
            count += 1
    return count


def test_children_and_chart_pass_strict_against_the_api_servers_schemas(
    cluster, tmp_path: Path
) -> None:
    kubeconform = tool("kubeconform")
    from atom_operator.kube import Kube

    kube = Kube.from_kubeconfig(str(cluster.kubeconfig))
    schemas = tmp_path / "schemas"
    schemas.mkdir()
    assert write_schemas(kube.request("GET", "/openapi/v2"), schemas) > 50
    manifests = tmp_path / "manifests"
    manifests.mkdir()
    write_children(manifests)
    write_chart(
        manifests,
        {
            "cluster": ["--set", "monitoring.grafanaDashboard.enabled=true"],
            "namespaced": ["--set", "scope=namespaced", "--set", "watchNamespaces={a,b}"],
        },
    )
    proc = subprocess.run(
        [kubeconform, "-strict", "-summary", "-schema-location", str(schemas / LOCATION),
         str(manifests)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Invalid: 0, Errors: 0" in proc.stdout, proc.stdout[-2000:]
