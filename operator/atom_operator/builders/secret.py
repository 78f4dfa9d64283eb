"""The per-AtomDeployment internal token shared by the router and the P/D instances."""

from __future__ import annotations

from typing import Any

from atom_operator import naming
from atom_operator.builders.common import Owner, metadata

TOKEN_KEY = "token"


def token_secret_name(instance: str) -> str:
    # Secret names are DNS-1123 subdomains (253): the instance name (≤ 63) always fits.
    return f"{instance}-internal-token"


def build_internal_token_secret(owner: Owner, name: str, token: str) -> dict[str, Any]:
    """Created once by the operator (never applied again, so never rotated); garbage-collected
    with the AtomDeployment through its ownerReference."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": metadata(owner, name, naming.labels(owner.name, "internal-token")),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def token_env(instance: str) -> dict[str, Any]:
    """ATOM_INTERNAL_TOKEN from the Secret: the router sends it, an instance honours
    kv_transfer only with it."""
    ref = {"name": token_secret_name(instance), "key": TOKEN_KEY}
    return {"name": "ATOM_INTERNAL_TOKEN", "valueFrom": {"secretKeyRef": ref}}
