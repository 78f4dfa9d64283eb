"""The operator's own Prometheus endpoint (`:8081/metrics`; ATOM_OPERATOR_METRICS_PORT, 0 off).

Kopf's health endpoint answers JSON on /healthz only, so these few series get their own small
HTTP server: reconciles and failed reconciles since start, reconcile latency quantiles, and
whether this replica leads.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LATENCY_WINDOW = 10000  # reconciles whose duration the quantiles cover


class ReconcileStats:
    """Reconciles and failed reconciles since start, and the latest durations (seconds)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.reconciles = 0
        self.failed_reconciles = 0

    def record(self, seconds: float, *, failed: bool) -> None:
        with self._lock:
            self.reconciles += 1
            self.failed_reconciles += failed
            self._latencies.append(seconds)

    def latencies(self) -> list[float]:
        """The window's durations, sorted."""
        with self._lock:
            return sorted(self._latencies)

    def summary(self) -> dict[str, float]:
        """Count and latency percentiles (the Kopf probe the benchmark reads)."""
        values = self.latencies()
        if not values:
            return {"count": 0}

        def pct(q: float) -> float:
            return round(values[min(len(values) - 1, int(q * len(values)))], 4)

        return {
            "count": len(values),
            "p50": pct(0.50),
            "p99": pct(0.99),
            "max": round(values[-1], 4),
        }


def render(stats: ReconcileStats, leading: bool) -> str:
    values = stats.latencies()
    lines = [
        "# HELP atom_operator_reconciles_total Reconciles since the operator started.",
        "# TYPE atom_operator_reconciles_total counter",
        f"atom_operator_reconciles_total {stats.reconciles}",
        "# HELP atom_operator_failed_reconciles_total Reconciles with a failed apply.",
        "# TYPE atom_operator_failed_reconciles_total counter",
        f"atom_operator_failed_reconciles_total {stats.failed_reconciles}",
        "# HELP atom_operator_reconcile_seconds Reconcile duration (last 10000).",
        "# TYPE atom_operator_reconcile_seconds summary",
    ]
    for q in (0.5, 0.9, 0.99):
        v = values[min(len(values) - 1, int(q * len(values)))] if values else 0.0
        lines.append(f'atom_operator_reconcile_seconds{{quantile="{q}"}} {v:.6f}')
    lines += [
        f"atom_operator_reconcile_seconds_sum {sum(values):.6f}",
        f"atom_operator_reconcile_seconds_count {len(values)}",
        "# HELP atom_operator_leader 1 while this replica holds the leader lease.",
        "# TYPE atom_operator_leader gauge",
        f"atom_operator_leader {int(leading)}",
    ]
    return "\n".join(lines) + "\n"


def serve(port: int, stats: ReconcileStats, leading: Callable[[], bool]) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404)
                return
            body = render(stats, leading()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:  # scrapes are not worth a log line
            return

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
