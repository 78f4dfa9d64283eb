"""Helpers of the real-node tests: polling with a deadline, JSON over HTTP to pod IPs, the
AtomDeployments and runtime pods of a namespace."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from atom_devtools.kubectl import Kubectl

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "realnode"
EXAMPLE = yaml.safe_load((ROOT / "examples" / "atomdeployment-cpu.yaml").read_text())


def http_json(url: str, timeout: float = 5) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            return err.code, json.loads(body)
        except ValueError:
            return err.code, body.decode(errors="replace")
    except OSError as err:
        return 0, str(err)


def apply(kubectl: Kubectl, manifest: dict[str, Any]) -> None:
    kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(manifest))


def atomd(kubectl: Kubectl, name: str) -> dict[str, Any]:
    return kubectl.json("atomd", name, "-n", NAMESPACE)


def runtime_pods(kubectl: Kubectl, name: str, role: str = "unified") -> list[dict]:
    """The role's pods that are not being deleted."""
    selector = f"app.kubernetes.io/instance={name},atom.dev/role={role}"
    pods = kubectl.json("pods", "-n", NAMESPACE, "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod["status"].get("conditions", []))  # fmt: skip


def status_of(pod: dict[str, Any]) -> dict[str, Any]:
    code, body = http_json(f"http://{pod['status']['podIP']}:8000/status")
    assert code == 200, body
    return body
