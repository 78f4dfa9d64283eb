"""Autoscaling with real parts on a real API server: KEDA's operator and metrics API server
(LocalCluster(keda=True)), the HPA of kube-controller-manager, and the operator.

The kwok pods have no network, so the metric comes from a stand-in /metrics served by this
test on the host's address, listed in an EndpointSlice of the endpoint Service (KEDA reads
every ready endpoint of that Service): KEDA's metrics-api scaler parses it, the aggregation
layer serves it as an external metric, and the HPA scales the AtomDeployment through its scale
subresource. tests/realnode/test_scale_out.py does the same with real runtime pods.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from atomd_e2e import Kubectl, atomd, condition, get, running_operator

from atom_operator import naming
from atom_operator.builders.autoscaling import hpa_name, inference_pool_name, scaled_object_name
from atom_operator.kube import Kube
from testutil import started_cluster, wait_for

NS = "scale"
NAME = "auto"
HPA = hpa_name(NAME, naming.UNIFIED)


class StandIn:
    """A /metrics endpoint answering one vllm:num_requests_waiting value, settable."""

    def __init__(self, host: str) -> None:
        self.waiting = 0.0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = (
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    f'vllm:num_requests_waiting{{model_name="tiny"}} {stand_in.waiting}\n'
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, naming.HTTP_PORT), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _host_address() -> str:
    """This host's address on its default route (an EndpointSlice refuses loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.123", 9))  # no packet is sent: picks the outgoing address
        return s.getsockname()[0]


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """This module's own control plane: KEDA needs the API server's front-proxy flags."""
    yield from started_cluster(addons=("keda", "gie"), keda=True)


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, env, tmp_path_factory) -> Iterator[object]:
    from atom_devtools.devcluster.crds import wait_crd_established
    from atom_devtools.devcluster.gie import inference_pool_crd

    kubectl("apply", "--server-side", "-f", str(inference_pool_crd()))
    wait_crd_established(kubectl, "inferencepools.inference.networking.k8s.io")
    log_dir: Path = tmp_path_factory.mktemp("operator-logs")
    with running_operator(kubectl, env, log_dir, NS) as op:
        yield op


def _quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _json(kubectl: Kubectl, *args: str) -> dict:
    got = kubectl("get", *args, "-n", NS, "-o", "json", check=False)
    return json.loads(got.stdout) if got.returncode == 0 else {}


def test_keda_scales_the_atomdeployment_on_queue_depth(operator, kubectl, kube: Kube) -> None:
    host = _host_address()
    try:
        stand_in = StandIn(host)
    except OSError as exc:
        pytest.fail(f"the stand-in /metrics cannot bind {host}:{naming.HTTP_PORT}: {exc}")
    spec = {
        "model": {"name": "tiny-llama", "loadFormat": "dummy"},
        "device": "cpu",
        "replicas": 1,
        "compileCache": {"enabled": False},
        "inferencePool": True,
        "autoscaling": {
            "minReplicas": 1, "maxReplicas": 3, "target": 2,
            "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0,
        },
    }  # fmt: skip
    kubectl.apply(atomd(NAME, NS, spec))
    try:
        # The operator renders the ScaledObject and the pool; the upstream CRD accepted it.
        so = wait_for("ScaledObject", lambda: _json(
            kubectl, "scaledobject", scaled_object_name(NAME, naming.UNIFIED)), timeout=60)
        assert so["spec"]["scaleTargetRef"]["kind"] == "AtomDeployment"
        pool = _json(kubectl, "inferencepool", inference_pool_name(NAME))
        assert pool["spec"]["targetPorts"] == [{"number": naming.HTTP_PORT}]
        # The stand-in joins the endpoint Service's endpoints (KEDA lists its EndpointSlices).
        kubectl.apply({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{NAME}-stand-in", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": NAME}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [host], "conditions": {"ready": True}}],
            "ports": [{"name": "http", "port": naming.HTTP_PORT, "protocol": "TCP"}],
        })  # fmt: skip
        # KEDA creates the HPA, aimed at the AtomDeployment's scale subresource.
        hpa = wait_for("KEDA's HPA", lambda: _json(kubectl, "hpa", HPA), timeout=60)
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "AtomDeployment"
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 3)

        # Queue depth 5 over target 2 per pod: the HPA reads it and asks for 3 pods.
        stand_in.waiting = 5
        wait_for("the HPA to read 5 waiting requests and scale to 3", lambda: (
            _json(kubectl, "hpa", HPA).get("status", {}).get("desiredReplicas") == 3
        ), timeout=120)  # fmt: skip
        st = _json(kubectl, "hpa", HPA)["status"]
        average = st["currentMetrics"][0]["external"]["current"]["averageValue"]
        assert abs(_quantity(average) * st["currentReplicas"] - 5) < 0.01, st  # sum / pods
        wait_for("spec.replicas 3 and three Ready pods", lambda: (
            get(kube, NS, NAME)["spec"].get("replicas") == 3
            and get(kube, NS, NAME).get("status", {}).get("currentReplicas") == "3"
        ), timeout=90)  # fmt: skip
        obj = get(kube, NS, NAME)
        assert obj["status"]["desiredReplicas"] == "3"
        auto = condition(obj, "AutoscalingReady")
        assert auto["status"] == "True", auto
        assert condition(obj, "InferencePoolReady")["status"] == "True"
        # the replica columns are in the wide view (the default view stays short)
        wide = kubectl("get", "atomd", NAME, "-n", NS, "-o", "wide").stdout.split("\n")
        assert wide[0].split()[-2:] == ["CURRENT", "DESIRED"], wide
        assert wide[1].split()[-2:] == ["3", "3"], wide

        # The queue drains: back to minReplicas.
        stand_in.waiting = 0
        wait_for("the HPA to scale back to 1", lambda: (
            get(kube, NS, NAME)["spec"].get("replicas") == 1
        ), timeout=120)  # fmt: skip
    finally:
        stand_in.server.shutdown()
        stand_in.server.server_close()


def test_cel_rules_on_the_api_server(operator, kubectl) -> None:
    bad_range = {"model": {"name": "m"}, "replicas": 1, "autoscaling": {
        "minReplicas": 3, "maxReplicas": 2, "target": 1}}  # fmt: skip
    bad_kv = {"model": {"name": "m"}, "replicas": 1, "autoscaling": {
        "maxReplicas": 2, "metric": "kvCacheUsage", "target": 1.5}}  # fmt: skip
    both = {"model": {"name": "m"}, "autoscaling": {"maxReplicas": 2, "target": 1},
            "disaggregation": {"prefill": {}, "decode": {}}}  # fmt: skip
    # Without spec.replicas the scale subresource fails, and KEDA would create no HPA.
    no_replicas = {"model": {"name": "m"}, "autoscaling": {"maxReplicas": 2, "target": 1}}
    for body, expect in ((bad_range, "minReplicas must be at most"),
                         (bad_kv, "fraction of the KV"),
                         (both, "disaggregation.prefill.autoscaling"),
                         (no_replicas, "spec.autoscaling needs spec.replicas")):  # fmt: skip
        got = kubectl.apply(atomd("bad", NS, body), "--dry-run=server", check=False)
        assert got.returncode != 0 and expect in got.stderr, got.stderr


def test_without_keda_crds_a_condition_says_so(operator, kubectl, kube: Kube) -> None:
    kubectl("delete", "crd", "scaledobjects.keda.sh")
    wait_for("ScaledObject no longer served", lambda: kubectl(
        "get", "scaledobjects", "-n", NS, check=False).returncode != 0, timeout=30)
    spec = {"model": {"name": "m", "loadFormat": "dummy"}, "device": "cpu", "replicas": 1,
            "compileCache": {"enabled": False},
            "autoscaling": {"maxReplicas": 2, "target": 4}}  # fmt: skip
    kubectl.apply(atomd("nokeda", NS, spec))
    cond = wait_for("AutoscalingReady=False KEDANotInstalled", lambda: (
        c if (c := condition(get(kube, NS, "nokeda"), "AutoscalingReady")).get("reason")
        == "KEDANotInstalled" else None
    ), timeout=60)  # fmt: skip
    assert cond["status"] == "False"
    obj = get(kube, NS, "nokeda")
    assert condition(obj, "Degraded")["status"] == "False", obj["status"]
    assert operator.proc.poll() is None  # no crash loop
