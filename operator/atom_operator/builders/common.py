"""Metadata shared by every child: names, labels, owner references."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from atom_operator.spec import GROUP, KIND, VERSION


@dataclass(frozen=True)
class Owner:
    """The AtomDeployment the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        # blockOwnerDeletion is left unset: it would need RBAC on atomdeployments/finalizers.
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
        }


def metadata(
    owner: Owner,
    name: str,
    labels: dict[str, str],
    *,
    annotations: dict[str, str] | None = None,
    owned: bool = True,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": owner.namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    if owned:
        meta["ownerReferences"] = [owner.reference()]
    return meta
