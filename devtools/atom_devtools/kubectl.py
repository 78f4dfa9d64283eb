"""kubectl bound to one local cluster, the CRD install and the AtomDeployment's readiness: the
library half of the demo, which the e2e and real-node tests use as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from atom_devtools.devcluster.crds import wait_crd_established

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "atomdeployment.yaml"
CRD_NAME = "atomdeployments.atom.dev"


class Kubectl:
    """kubectl bound to one cluster's environment (KUBECONFIG, PATH with the cached binaries)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(os.environ, **env)

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed:\n{result.stderr.strip()}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self("get", *args, "-o", "json").stdout)

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Another tool (helm) in the same environment; raises with its stderr on failure."""
        result = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{result.stderr.strip()}")
        return result


def install_crd(kubectl: Kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    wait_crd_established(kubectl, CRD_NAME)


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions") or []}


def is_ready(obj: dict[str, Any]) -> bool:
    """Ready=True for the current generation (what `kubectl wait --for=condition=Ready` means)."""
    status = obj.get("status", {})
    ready = _conditions(obj).get("Ready", {})
    return (
        status.get("observedGeneration") == obj["metadata"].get("generation")
        and ready.get("status") == "True"
    )


def describe(obj: dict[str, Any]) -> str:
    status = obj.get("status", {})
    conditions = _conditions(obj)
    parts = [f"phase={status.get('phase', '-')}", f"ready={status.get('ready', '-')}"]
    for kind in ("Ready", "Progressing", "Degraded", "CompileCacheReady"):
        if kind in conditions:
            c = conditions[kind]
            parts.append(f"{kind}={c['status']}({c.get('reason', '')})")
    return " ".join(parts)


def wait_ready(
    kubectl: Kubectl,
    name: str,
    namespace: str,
    timeout: float = 180,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Poll the AtomDeployment until Ready; report each change of its status line."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        obj = kubectl.json("atomd", name, "-n", namespace)
        line = describe(obj)
        if progress and line != last:
            progress(line)
            last = line
        if is_ready(obj):
            return obj
        if time.monotonic() > deadline:
            degraded = [c for c in obj.get("status", {}).get("conditions", [])
                        if c.get("type") == "Degraded" and c.get("status") == "True"]
            why = f" ({degraded[0].get('message', '')})" if degraded else ""
            raise TimeoutError(f"atomd/{name} not Ready after {timeout}s: {line}{why}")
        time.sleep(1)
