"""The GitOps snippets of docs/gitops.md, read out of the document itself so that it cannot
drift from what the tests prove: Argo CD's Lua health check (evaluated here with lupa, like
Argo CD's gopher-lua: Argo CD does not build here) and Flux's GitRepository and Kustomization
(applied to the real Flux by test_gitops_flux.py).
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


def flux_manifests() -> tuple[dict[str, Any], dict[str, Any]]:
    """The GitRepository and the Kustomization docs/gitops.md shows: what
    tests/e2e/test_gitops_flux.py applies for the real Flux (the demo's reader)."""
    from atom_devtools.demo_gitops import doc_flux_manifests

    return doc_flux_manifests()


def argo_health(obj: dict[str, Any]) -> tuple[str, str]:
    """(status, message) as Argo CD would show them."""
    from lupa import LuaRuntime

    lua = LuaRuntime(unpack_returned_tuples=True)
    lua.globals().obj = lua.table_from(obj, recursive=True)
    result = lua.execute(argo_lua())
    return str(result["status"]), str(result["message"])
