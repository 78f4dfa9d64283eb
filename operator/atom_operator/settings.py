"""Operator settings from the environment (docs/architecture.md)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    default_image: str = "ghcr.io/atom-serving/atom-runtime:0.1.0"
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    log_level: str = "INFO"
    reconcile_interval: float = 30.0
    health_port: int = 8080
    allow_host_volumes: bool = False  # hostPath, flexVolume, gitRepo in model.volume

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
            allow_host_volumes=env.get("ATOM_OPERATOR_ALLOW_HOST_VOLUMES", "").lower()
            in ("1", "true", "yes"),
        )
