"""Monitoring: the opt-in PodMonitor, its condition, the operator's own /metrics, and the
Grafana dashboard's queries against the metric names the runtime really exports."""

from __future__ import annotations

import json
import re
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from atomd_helpers import IMAGE, OWNER, spec

from atom_operator import builders, naming
from atom_operator.snapshot import Snapshot
from atom_operator.status import compute_status

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "charts" / "atom-operator" / "dashboards" / "atom-runtime.json"


def _monitor(**changes):
    objs = builders.plan(OWNER, spec("disaggregated", **changes), IMAGE, Snapshot()).apply
    return [o for o in objs if o["kind"] == "PodMonitor"]


def test_pod_monitor_only_when_enabled() -> None:
    assert _monitor() == []
    (mon,) = _monitor(monitoring={"enabled": True, "interval": "15s", "labels": {"release": "kp"}})
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert mon["metadata"]["labels"]["release"] == "kp"
    sel = mon["spec"]["selector"]
    assert sel["matchLabels"] == naming.selector_labels("demo")
    assert sel["matchExpressions"][0]["values"] == ["runtime", "router"]
    (ep,) = mon["spec"]["podMetricsEndpoints"]
    assert ep == {"port": "http", "path": "/metrics", "interval": "15s"}
    assert naming.LABEL_ROLE in mon["spec"]["podTargetLabels"]


def test_missing_crd_is_a_condition_not_a_failure() -> None:
    s = spec("unified", monitoring={"enabled": True})
    p = builders.plan(OWNER, s, IMAGE, Snapshot())
    now = datetime(2026, 1, 1, tzinfo=UTC)
    st = compute_status(
        name="demo", spec=s, generation=1, snap=Snapshot(), plan=p, now=now,
        monitoring_unavailable=True,
    )  # fmt: skip
    cond = {c["type"]: c for c in st["conditions"]}
    assert cond["MonitoringReady"]["status"] == "False"
    assert cond["MonitoringReady"]["reason"] == "PodMonitorCRDMissing"
    assert "ApplyFailed" not in cond["Degraded"]["reason"]
    off = compute_status(
        name="demo", spec=spec("unified"), generation=1, snap=Snapshot(), plan=p, now=now
    )
    assert "MonitoringReady" not in {c["type"] for c in off["conditions"]}


def test_operator_metrics_endpoint() -> None:
    from atom_operator import metrics

    stats = metrics.ReconcileStats()
    stats.record(0.25, failed=False)
    stats.record(0.5, failed=True)
    server = metrics.serve(0, stats, lambda: True)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    finally:
        server.shutdown()
    assert f"atom_operator_reconciles_total {stats.reconciles}" in text
    assert "atom_operator_reconciles_total 2" in text
    assert "atom_operator_failed_reconciles_total 1" in text
    assert "atom_operator_leader 1" in text
    assert 'atom_operator_reconcile_seconds{quantile="0.99"}' in text


def test_dashboard_queries_name_metrics_the_runtime_exports() -> None:
    from atom.entrypoints import metrics as runtime_metrics

    source = (ROOT / "runtime" / "atom" / "entrypoints" / "metrics.py").read_text()
    exported = set(re.findall(r'"(atom_[a-z_]+)"', source))
    exported |= {f"atom_{c}" for c in runtime_metrics.DOCUMENTED_COUNTERS}
    exported |= {name for name, _ in runtime_metrics.ENGINE_GAUGES.values()}
    dash = json.loads(DASHBOARD.read_text())
    titles = {p["title"] for p in dash["panels"]}
    for want in ("Time to first token", "Inter-token latency", "Throughput", "KV cache usage"):
        assert want in titles
    used = set()
    for panel in dash["panels"]:
        for target in panel["targets"]:
            used |= set(re.findall(r"\b(atom_(?!dev_)[a-z_]+)", target["expr"]))  # not labels
    assert used
    for name in used:
        base = re.sub(r"_(bucket|total)$", "", name)
        assert name in exported or base in exported, f"{name}: the runtime exports no {base}"
