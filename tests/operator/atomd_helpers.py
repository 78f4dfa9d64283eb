"""Shared fixtures-as-functions for the operator unit tests."""

from __future__ import annotations

from typing import Any

from atom_operator.builders import Owner
from atom_operator.models import AtomDeploymentSpec

OWNER = Owner(name="demo", namespace="serving", uid="0b7c1f3e-0000-4000-8000-000000000001")
IMAGE = "registry.example/atom-runtime:1.0"

SPECS: dict[str, dict[str, Any]] = {
    "unified": {"model": {"name": "llama-3.2-1b", "loadFormat": "dummy"}, "replicas": 2},
    "disaggregated": {
        "model": {
            "name": "qwen3-0.6b",
            "path": "/models/qwen3",
            "volume": {"persistentVolumeClaim": {"claimName": "weights"}},
        },
        "engine": {"maxNumSeqs": 64, "maxModelLen": 2048},
        "compilation": {"level": 3, "cudagraphMode": "TR_HYBRID"},
        "disaggregation": {
            "prefill": {"replicas": 1},
            "decode": {"replicas": 2},
            "router": {"replicas": 1},
        },
    },
    "full-decode-only": {
        "model": {"name": "llama-3.2-1b"},
        "compilation": {"level": 2, "cudagraphMode": "FULL_DECODE_ONLY"},
        "compileCache": {"existingClaim": "shared-cache", "warmup": True},
    },
    "custom-sizes": {
        "model": {"name": "llama-3.2-1b", "loadFormat": "dummy"},
        "engine": {"maxNumSeqs": 32, "enforceEager": False},
        "compilation": {
            "level": 3,
            "cudagraphMode": "FULL",
            "cudagraphCaptureSizes": [16, 1, 2, 4, 8],
            "splittingOps": ["aiter.unified_attention_with_output"],
            "compileSizes": ["cudagraph_capture_sizes"],
            "inductorCompileConfig": {"max_autotune": True},
        },
        "compileCache": {"storageClassName": "fast", "size": "5Gi", "retainOnDelete": False},
        "resources": {"limits": {"nvidia.com/gpu": 2}},
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        "nodeSelector": {"gpu": "h200"},
        "restartId": "2026-11-29",
    },
}


def spec(name_or_body: str | dict[str, Any], **changes: Any) -> AtomDeploymentSpec:
    body = SPECS[name_or_body] if isinstance(name_or_body, str) else name_or_body
    return AtomDeploymentSpec.model_validate({**body, **changes})
