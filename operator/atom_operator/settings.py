"""Operator settings from the environment (docs/architecture.md)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


@dataclass(frozen=True)
class Settings:
    default_image: str = "ghcr.io/atom-serving/atom-runtime:0.1.0"
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    log_level: str = "INFO"
    reconcile_interval: float = 30.0
    health_port: int = 8080
    metrics_port: int = 8081  # 0: no /metrics endpoint
    allow_host_volumes: bool = False  # hostPath, flexVolume, gitRepo in model.volume
    leader_election: bool = True
    lease_namespace: str = "default"
    lease_name: str = "atom-operator"
    identity: str = ""
    lease_seconds: float = 15.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        namespaces = tuple(
            n.strip() for n in env.get("ATOM_OPERATOR_NAMESPACES", "").split(",") if n.strip()
        )
        interval = float(env.get("ATOM_OPERATOR_RECONCILE_INTERVAL", cls.reconcile_interval))
        if interval <= 0:
            raise ValueError(f"ATOM_OPERATOR_RECONCILE_INTERVAL must be > 0, got {interval}")
        return cls(
            default_image=env.get("ATOM_OPERATOR_DEFAULT_IMAGE", cls.default_image)
            or cls.default_image,
            namespaces=namespaces,
            log_level=env.get("ATOM_OPERATOR_LOG_LEVEL", cls.log_level).upper(),
            reconcile_interval=interval,
            health_port=int(env.get("ATOM_OPERATOR_HEALTH_PORT", cls.health_port)),
            metrics_port=int(env.get("ATOM_OPERATOR_METRICS_PORT", cls.metrics_port)),
            allow_host_volumes=_flag(env.get("ATOM_OPERATOR_ALLOW_HOST_VOLUMES"), False),
            leader_election=_flag(env.get("ATOM_OPERATOR_LEADER_ELECTION"), True),
            lease_namespace=env.get("ATOM_OPERATOR_LEASE_NAMESPACE")
            or _own_namespace()
            or (namespaces[0] if namespaces else cls.lease_namespace),
            lease_name=env.get("ATOM_OPERATOR_LEASE_NAME", cls.lease_name) or cls.lease_name,
            # The pod name: a restarted container keeps it and takes its own lease back at once.
            identity=env.get("ATOM_OPERATOR_IDENTITY")
            or env.get("POD_NAME")
            or socket.gethostname(),
            lease_seconds=float(env.get("ATOM_OPERATOR_LEASE_SECONDS", cls.lease_seconds)),
        )


def _flag(text: str | None, default: bool) -> bool:
    if text is None or not text.strip():
        return default
    return text.strip().lower() in ("1", "true", "yes", "on")


def _own_namespace() -> str | None:
    """The pod's namespace in a cluster (where the chart's Role on leases is)."""
    try:
        return _SA_NAMESPACE.read_text().strip() or None
    except OSError:
        return None
