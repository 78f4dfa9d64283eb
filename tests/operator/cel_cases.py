"""Specs the CRD's tensor-parallel and KV-transport rules refuse or accept: judged by a real
API server (test_parallelism_cel.py) and by cel-python without a cluster (test_crd_rules.py)."""

from __future__ import annotations

from typing import Any

GPU = "nvidia.com/gpu"
BASE: dict[str, Any] = {"model": {"name": "tiny-llama", "loadFormat": "dummy"}}


def res(limit: Any = None, request: Any = None, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if limit is not None:
        out["limits"] = {GPU: limit}
    if request is not None:
        out["requests"] = {GPU: request}
    for kind, amounts in extra.items():
        out.setdefault(kind, {}).update(amounts)
    return out


# case: (spec changes, field the error names, words of its message)
REFUSED: dict[str, tuple[dict[str, Any], str, str]] = {
    "tensor 3": ({"parallelism": {"tensor": 3}}, "spec.parallelism.tensor", "power of two"),
    "tensor 6": ({"parallelism": {"tensor": 6}}, "spec.parallelism.tensor", "power of two"),
    "tensor 16": ({"parallelism": {"tensor": 16}}, "spec.parallelism.tensor", "less than or equal"),
    "tensor 0": (
        {"parallelism": {"tensor": 0}},
        "spec.parallelism.tensor",
        "greater than or equal",
    ),
    "limit below tensor": (
        {"parallelism": {"tensor": 2}, "resources": res(limit=1)},
        "spec.parallelism.tensor",
        "resources.limits/requests nvidia.com/gpu must equal parallelism.tensor",
    ),
    "string request above tensor": (
        {"parallelism": {"tensor": 2}, "resources": res(request="4", limit="4")},
        "spec.parallelism.tensor",
        "must equal parallelism.tensor",
    ),
    "request differs from a matching limit": (
        {"parallelism": {"tensor": 2}, "resources": res(limit=2, request=1)},
        "spec.parallelism.tensor",
        "must equal parallelism.tensor",
    ),
    "prefill tensor vs inherited resources": (
        {
            "resources": res(limit=1),
            "disaggregation": {"prefill": {"parallelism": {"tensor": 2}}, "decode": {}},
        },
        "spec.disaggregation.prefill.parallelism",
        "disaggregation.prefill.resources (or of resources",
    ),
    "decode resources vs inherited tensor": (
        {
            "parallelism": {"tensor": 4},
            "disaggregation": {"prefill": {}, "decode": {"resources": res(limit=2)}},
        },
        "spec.disaggregation.decode.parallelism",
        "must equal disaggregation.decode.parallelism.tensor (or parallelism.tensor",
    ),
    "role tensor 5": (
        {"disaggregation": {"prefill": {}, "decode": {"parallelism": {"tensor": 5}}}},
        "spec.disaggregation.decode.parallelism.tensor",
        "power of two",
    ),
    "nccl on cpu": (
        {"device": "cpu", "disaggregation": {"prefill": {}, "decode": {}, "kvTransport": "nccl"}},
        "spec.disaggregation.kvTransport",
        "cuda-ipc and nccl need device gpu",
    ),
    "cuda-ipc on cpu": (
        {
            "device": "cpu",
            "disaggregation": {"prefill": {}, "decode": {}, "kvTransport": "cuda-ipc"},
        },
        "spec.disaggregation.kvTransport",
        "need device gpu",
    ),
    "unknown transport": (
        {"disaggregation": {"prefill": {}, "decode": {}, "kvTransport": "rdma"}},
        "spec.disaggregation.kvTransport",
        "Unsupported value",
    ),
}

ACCEPTED: dict[str, dict[str, Any]] = {
    "tensor 2, GPU count rendered": {"parallelism": {"tensor": 2}},
    "tensor 8 with matching int and string counts": {
        "parallelism": {"tensor": 8},
        "resources": res(limit=8, request="8", limits={"memory": "64Gi"}, requests={"cpu": 0.5}),
    },
    # specs from before the field: a count beside an unset tensor size is left alone
    "count without tensor": {"resources": res(limit=2)},
    "cpu: tensor 2, a GPU count the operator drops": {
        "device": "cpu",
        "parallelism": {"tensor": 2},
        "resources": res(limit=1),
    },
    "per role sizes with their own counts": {
        "parallelism": {"tensor": 2},
        "resources": res(limit=2),
        "disaggregation": {
            "prefill": {"parallelism": {"tensor": 4}, "resources": res(limit=4, request=4)},
            "decode": {},
            "kvTransport": "cuda-ipc",
        },
    },
    "role size with inherited count and no shared size": {
        "resources": res(limit=1),
        "disaggregation": {"prefill": {"parallelism": {"tensor": 1}}, "decode": {}},
    },
    "shared size unused by disaggregated roles": {
        # the unified rule does not apply: both roles size and count their own pods
        "parallelism": {"tensor": 2},
        "resources": res(limit=1),
        "disaggregation": {
            "prefill": {"parallelism": {"tensor": 1}},
            "decode": {"parallelism": {"tensor": 1}},
        },
    },
    "nccl on gpu": {"disaggregation": {"prefill": {}, "decode": {}, "kvTransport": "nccl"}},
    "tcp on cpu": {
        "device": "cpu",
        "disaggregation": {"prefill": {}, "decode": {}, "kvTransport": "tcp"},
    },
}
