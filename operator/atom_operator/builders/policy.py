"""Isolation and availability around the pods: NetworkPolicies and PodDisruptionBudgets.

NetworkPolicies (ingress only; each pod is selected by exactly one, so what it admits is what
that one says):
- `<name>-endpoint`: the endpoint pods (unified, or the router) accept their HTTP port from
  `networkPolicy.endpointFrom` (default: every pod of every namespace).
- `<name>-prefill`: prefill pods accept HTTP from this AtomDeployment's router (and
  `metricsFrom`), and the KV port only from its decode pods (the port the blocks are pulled
  from).
- `<name>-decode`: decode pods accept HTTP from the router (and `metricsFrom`); their own KV
  port from nobody.
- With `kvTransport` nccl or auto, the pair's pods accept every TCP port from each other: the
  nccl path's TCPStore and NCCL's own bootstrap listen on ephemeral ports on both sides, and a
  blocked one would stall each co-located pull until its group timeout before TCP took over.
Peers are matched by the instance and role labels, so every revision is covered by one policy.
"""

from __future__ import annotations

from typing import Any

from atom_operator import naming, runtime_args
from atom_operator.builders.common import Owner, metadata
from atom_operator.spec import AtomDeploymentSpec

ALL_NAMESPACES: list[dict[str, Any]] = [{"namespaceSelector": {}}]
ANY_TCP: dict[str, Any] = {"protocol": "TCP"}  # no port: every TCP port
NCCL_CAPABLE = ("auto", "nccl")  # transports that may negotiate nccl (ephemeral ports)


def policy_name(instance: str, part: str) -> str:
    return naming.child_name(instance, part)


def _peer(instance: str, role: str) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": naming.selector_labels(instance, role)}}


def _policy(owner: Owner, part: str, role: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(
            owner, policy_name(owner.name, part), naming.labels(owner.name, "network-policy", role)
        ),
        "spec": {
            "podSelector": {"matchLabels": naming.selector_labels(owner.name, role)},
            "policyTypes": ["Ingress"],
            "ingress": rules,
        },
    }


def build_network_policies(owner: Owner, spec: AtomDeploymentSpec) -> list[dict[str, Any]]:
    np = spec.network_policy
    if not np.enabled:
        return []
    http = {"protocol": "TCP", "port": naming.HTTP_PORT}
    kv = {"protocol": "TCP", "port": naming.KV_PORT}
    endpoint_role = naming.ROUTER if spec.disaggregated else naming.UNIFIED
    endpoint_from = np.endpoint_from if np.endpoint_from is not None else ALL_NAMESPACES
    out = [_policy(owner, "endpoint", endpoint_role, [{"from": endpoint_from, "ports": [http]}])]
    if spec.disaggregation is None:
        return out
    router = [_peer(owner.name, naming.ROUTER)]
    http_from = router + list(np.metrics_from or [])
    pair_tcp = spec.disaggregation.kv_transport in NCCL_CAPABLE
    from_decode = [_peer(owner.name, naming.DECODE)]
    prefill_rules = [
        {"from": http_from, "ports": [http]},
        {"from": from_decode, "ports": [ANY_TCP if pair_tcp else kv]},
    ]
    decode_rules = [{"from": http_from, "ports": [http]}]
    if pair_tcp:
        decode_rules.append({"from": [_peer(owner.name, naming.PREFILL)], "ports": [ANY_TCP]})
    out.append(_policy(owner, naming.PREFILL, naming.PREFILL, prefill_rules))
    out.append(_policy(owner, naming.DECODE, naming.DECODE, decode_rules))
    return out


def build_disruption_budgets(owner: Owner, spec: AtomDeploymentSpec) -> list[dict[str, Any]]:
    """One budget per role with two or more pods: a drain takes at most one pod of a role at a
    time. The selector has no revision label, so old and new revisions of a rollout count
    together. Pods that are not Ready may always be evicted (a crash-looping pod must not
    block a node drain)."""
    roles = runtime_args.roles(spec) + ([naming.ROUTER] if spec.disaggregated else [])
    out = []
    for role in roles:
        if runtime_args.role_replicas(spec, role) < 2:
            continue
        out.append(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": metadata(
                    owner,
                    naming.child_name(owner.name, role),
                    naming.labels(owner.name, "disruption-budget", role),
                ),
                "spec": {
                    "maxUnavailable": 1,
                    "selector": {"matchLabels": naming.selector_labels(owner.name, role)},
                    "unhealthyPodEvictionPolicy": "AlwaysAllow",
                },
            }
        )
    return out
