"""Waiting for a CustomResourceDefinition to be served, with any kubectl-like callable.

`kubectl wait --for=condition=Established` right after the CRD is created fails at once
("<nil> is of the type <nil>") while the new object has no status.conditions yet, instead of
waiting for them; so the condition is polled.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable

KubectlRun = Callable[..., subprocess.CompletedProcess]  # kubectl(*args, check=...)


def wait_crd_established(kubectl: KubectlRun, name: str, timeout: float = 60.0) -> None:
    """Return once crd/`name` reports Established=True; RuntimeError after `timeout` s."""
    deadline = time.monotonic() + timeout
    conditions: list[dict] = []
    while True:
        got = kubectl("get", f"crd/{name}", "-o", "json", check=False)
        if got.returncode == 0:
            conditions = json.loads(got.stdout).get("status", {}).get("conditions") or []
            if any(c.get("type") == "Established" and c.get("status") == "True"
                   for c in conditions):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"crd/{name} not Established after {timeout:.0f}s: {conditions}")
        time.sleep(0.2)
