"""Argo CD's health check of docs/gitops.md on the status shapes the operator writes.

Argo CD does not build here (no version of gitops-engine passes `go get`), so its Lua runs in
lupa; Flux's checks run in the real Flux instead (test_gitops_flux.py). No cluster needed;
tests/e2e/test_examples.py runs the same check on live objects.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("lupa", reason="lupa runs the Argo CD Lua check (pip install lupa)")

from gitops_health import argo_health  # noqa: E402


def obj(generation: int, status: dict[str, Any] | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "apiVersion": "atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": "m", "generation": generation},
        "spec": {"model": {"name": "tiny-llama"}},
    }
    if status is not None:
        out["status"] = status
    return out


def cond(type_: str, status: str, reason: str = "R", message: str = "") -> dict[str, str]:
    return {"type": type_, "status": status, "reason": reason, "message": message}


READY = [
    cond("Ready", "True", "AllRolesReady", "1/1 ready"),
    cond("Progressing", "False"),
    cond("Degraded", "False"),
]
CASES = {
    "no status yet": (obj(1, None), "Progressing"),
    "status without conditions": (obj(1, {"observedGeneration": 1}), "Progressing"),
    "ready": (obj(3, {"observedGeneration": 3, "conditions": READY}), "Healthy"),
    "new generation not observed": (
        obj(4, {"observedGeneration": 3, "conditions": READY}),
        "Progressing",
    ),
    "rolling out": (
        obj(
            4,
            {
                "observedGeneration": 4,
                "conditions": [
                    cond("Ready", "True", "AllRolesReady"),
                    cond("Progressing", "True", "RollingOut", "1/2 updated"),
                ],
            },
        ),
        "Progressing",
    ),
    "not ready": (
        obj(2, {"observedGeneration": 2, "conditions": [cond("Ready", "False", "Capturing")]}),
        "Progressing",
    ),
    "degraded": (
        obj(
            2,
            {
                "observedGeneration": 2,
                "conditions": [
                    cond("Ready", "False", "PodsNotReady"),
                    cond("Degraded", "True", "CaptureOutOfMemory", "decode pod"),
                ],
            },
        ),
        "Degraded",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_argo_cd_health(case: str) -> None:
    manifest, argo = CASES[case]
    status, message = argo_health(manifest)
    assert status == argo, message
    assert message, "Argo CD shows the message; it should say why"


def test_degraded_message_names_the_reason() -> None:
    manifest = CASES["degraded"][0]
    assert argo_health(manifest)[1] == "CaptureOutOfMemory: decode pod"
