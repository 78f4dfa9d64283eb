"""Skip server-side applies that cannot change anything.

After each apply we remember what we sent and the object's version as the API server returned
it. If the observed object is still at that version (nobody touched it) and the desired manifest
is the same, the apply would be a no-op: skip the round trip. Any edit by hand bumps the version,
so it is still restored on the next reconcile. Deployments and Jobs compare `generation` (their
status churns the resourceVersion) plus our labels, since label edits do not bump generation.
"""

from __future__ import annotations

import threading
from typing import Any

from atom_operator import naming

_GENERATION_KINDS = ("Deployment", "Job")


class AppliedCache:
    def __init__(self) -> None:
        self._seen: dict[tuple[str, str, str], tuple[str, str]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(obj: dict[str, Any]) -> tuple[str, str, str]:
        return obj["kind"], obj["metadata"]["namespace"], obj["metadata"]["name"]

    @staticmethod
    def _version(kind: str, observed: dict[str, Any]) -> str:
        meta = observed["metadata"]
        if kind in _GENERATION_KINDS:
            return f"g{meta.get('generation')}:{meta.get('uid')}"
        return f"r{meta.get('resourceVersion')}"

    def unchanged(self, desired: dict[str, Any], observed: dict[str, Any] | None) -> bool:
        """True when applying `desired` again cannot change `observed`."""
        if observed is None or observed["metadata"].get("deletionTimestamp"):
            return False
        with self._lock:
            seen = self._seen.get(self._key(desired))
        if seen is None or seen != (
            naming.digest(desired, 16),
            self._version(desired["kind"], observed),
        ):
            return False
        labels = observed["metadata"].get("labels") or {}
        return all(labels.get(k) == v for k, v in desired["metadata"].get("labels", {}).items())

    def record(self, desired: dict[str, Any], returned: dict[str, Any]) -> None:
        entry = (naming.digest(desired, 16), self._version(desired["kind"], returned))
        with self._lock:
            self._seen[self._key(desired)] = entry

    def forget(self, kind: str, namespace: str, name: str) -> None:
        with self._lock:
            self._seen.pop((kind, namespace, name), None)
