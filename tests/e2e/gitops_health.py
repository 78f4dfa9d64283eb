"""Evaluate the Argo CD (Lua) and Flux (CEL) health checks published in docs/gitops.md.

The checks are read out of the document itself, so the document cannot drift from what the
tests prove. lupa runs the Lua like Argo CD's gopher-lua; cel-python evaluates the CEL the
way Flux's kustomize-controller binds it (the object's top-level fields as variables).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from typing import Any

import yaml

DOC = Path(__file__).resolve().parents[2] / "docs" / "gitops.md"
ARGO_KEY = "resource.customizations.health.atom.dev_AtomDeployment"


def _yaml_blocks() -> list[Any]:
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if doc]


@cache
def argo_lua() -> str:
    for doc in _yaml_blocks():
        if doc.get("kind") == "ConfigMap" and ARGO_KEY in doc.get("data", {}):
            return doc["data"][ARGO_KEY]
    raise AssertionError(f"docs/gitops.md has no argocd-cm with {ARGO_KEY}")


@cache
def flux_exprs() -> dict[str, str]:
    for doc in _yaml_blocks():
        if doc.get("kind") == "Kustomization":
            for check in doc["spec"].get("healthCheckExprs", []):
                if check["kind"] == "AtomDeployment" and check["apiVersion"] == "atom.dev/v1alpha1":
                    return {
                        k: v for k, v in check.items() if k in ("current", "inProgress", "failed")
                    }
    raise AssertionError("docs/gitops.md has no Flux healthCheckExprs for AtomDeployment")


def argo_health(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) as Argo CD would show them."""
    from lupa import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(argo_lua())
    return str(result["status"]), str(result["message"])


def flux_health(obj: dict[str, Any]) -> str:
    """Current, InProgress or Failed, in the order Flux's CEL status reader checks them."""
    import celpy

    env = celpy.Environment()
    activation = {
        key: celpy.json_to_cel(obj.get(key, {})) for key in ("metadata", "spec", "status")
    }

    def holds(name: str) -> bool:
        expr = flux_exprs().get(name)
        if expr is None:
            return False
        result = env.program(env.compile(expr)).evaluate(activation)
        if isinstance(result, Exception):
            raise result
        return bool(result)

    if holds("failed"):
        return "Failed"
    if holds("current"):
        return "Current"
    return "InProgress"
