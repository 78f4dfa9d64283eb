"""The PodMonitor that tells a Prometheus Operator to scrape the pods' /metrics (opt-in)."""

from __future__ import annotations

from typing import Any

from atom_operator import naming
from atom_operator.builders.common import Owner, metadata
from atom_operator.spec import AtomDeploymentSpec

POD_MONITOR_API = "monitoring.coreos.com/v1"
# Pod labels copied onto every series, so the dashboard can split by deployment, role, revision.
TARGET_LABELS = [naming.LABEL_INSTANCE, naming.LABEL_ROLE, naming.LABEL_REVISION]


def build_pod_monitor(owner: Owner, spec: AtomDeploymentSpec) -> dict[str, Any] | None:
    mon = spec.monitoring
    if not mon.enabled:
        return None
    labels = {**(mon.labels or {}), **naming.labels(owner.name, "monitoring")}
    return {
        "apiVersion": POD_MONITOR_API,
        "kind": "PodMonitor",
        "metadata": metadata(owner, naming.child_name(owner.name, "metrics"), labels),
        "spec": {
            "selector": {
                "matchLabels": naming.selector_labels(owner.name),
                # serving pods only: warm-up pods come and go within minutes
                "matchExpressions": [
                    {
                        "key": naming.LABEL_COMPONENT,
                        "operator": "In",
                        "values": ["runtime", "router"],
                    }
                ],
            },
            "podTargetLabels": TARGET_LABELS,
            "podMetricsEndpoints": [{"port": "http", "path": "/metrics", "interval": mon.interval}],
        },
    }
