"""AtomDeployments whose runtime pods really run (CPU, tiny model) on the real node.

The tests run in file order and share one unified AtomDeployment (the CPU example at level 3
with Inductor): cold start (the startup probe holds the pod un-Ready through compile), warm
start from the compile cache on the PVC, rollout under load, P/D against it, and finally its
deletion (the claim stays).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from realnode_helpers import (
    EXAMPLE,
    NAMESPACE,
    apply,
    atomd,
    http_json,
    pod_ready,
    runtime_pods,
    status_of,
)

from atom_devtools.kubectl import Kubectl, is_ready
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.slow]

NAME = EXAMPLE["metadata"]["name"]
MODEL = EXAMPLE["spec"]["model"]["name"]
PROMPT = "The capital of France is"
READY_TIMEOUT = 600
TIMES: dict[str, float] = {}


def service_url(kubectl: Kubectl, name: str = NAME) -> str:
    svc = kubectl.json("service", name, "-n", NAMESPACE)
    return f"http://{svc['spec']['clusterIP']}:8000/v1"


def greedy(url: str, max_tokens: int = 8) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                    temperature=0.0, logprobs=1)  # fmt: skip
    return (
        list(out.choices[0].logprobs.tokens) if out.choices[0].logprobs else [out.choices[0].text]
    )


@pytest.fixture(scope="module")
def unified(operator_release: str, kubectl: Kubectl) -> dict[str, Any]:
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"]["namespace"] = NAMESPACE
    # Inductor (the CPU image has g++ and Python's headers): its compiled pieces are what the
    # claim keeps for the warm start (without Inductor there is nothing to keep).
    manifest["spec"]["compilation"]["useInductor"] = True
    return manifest


def test_startup_probe_holds_the_pod_until_compile_is_done(
    unified: dict[str, Any], kubectl: Kubectl
) -> None:
    applied = time.monotonic()
    apply(kubectl, unified)
    seen_unready_503 = []

    def progress() -> bool:
        pods = runtime_pods(kubectl, NAME)
        if not pods or not pods[0]["status"].get("podIP"):
            return False
        pod = pods[0]
        code, body = http_json(f"http://{pod['status']['podIP']}:8000/health", timeout=2)
        if code == 503 and not pod_ready(pod) and not is_ready(atomd(kubectl, NAME)):
            seen_unready_503.append(body)
        return pod_ready(pod) and is_ready(atomd(kubectl, NAME))

    wait_for("the unified pod and atomd to be Ready", progress, timeout=READY_TIMEOUT, interval=0.5)
    TIMES["cold_ready_s"] = time.monotonic() - applied
    # /health said 503 while the pod ran un-Ready: the startup probe gated it through compile
    assert seen_unready_503, "never saw the pod running but un-Ready with /health 503"
    status = status_of(runtime_pods(kubectl, NAME)[0])
    assert status["device"] == "cpu" and status["level"] == 3 and status["mode"] == "NONE"
    TIMES["cold_compile_s"] = status["warmup"]["compile_seconds"]
    TIMES["cold_warmup_s"] = status["warmup"]["warmup_seconds"]
    cold = status["warmup"]["counters"]
    # Inductor really ran in the pod (a C++ compiler is there) and left its pieces on the claim
    assert cold.get("pieces_compiled", 0) > 0 and cold.get("artifacts_saved", 0) > 0, cold
    assert greedy(service_url(kubectl))
    print(f"\ncold start: {TIMES}")


def test_deleted_pod_comes_back_warm_from_the_pvc_cache(kubectl: Kubectl) -> None:
    old = runtime_pods(kubectl, NAME)[0]
    cold = status_of(old)
    start = time.monotonic()
    kubectl("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=false")
    pod = wait_for(
        "a new Ready pod",
        lambda: next((p for p in runtime_pods(kubectl, NAME)
                      if p["metadata"]["uid"] != old["metadata"]["uid"] and pod_ready(p)), None),
        timeout=READY_TIMEOUT,
    )  # fmt: skip
    TIMES["warm_ready_s"] = time.monotonic() - start
    warm = status_of(pod)
    TIMES["warm_compile_s"] = warm["warmup"]["compile_seconds"]
    TIMES["warm_warmup_s"] = warm["warmup"]["warmup_seconds"]
    print(f"\ncold vs warm start: {TIMES}")
    assert warm["cache_key"] == cold["cache_key"]  # the same directory on the same claim
    cold_counters, warm_counters = cold["warmup"]["counters"], warm["warmup"]["counters"]
    # every piece the cold pod compiled comes from the claim; nothing is compiled again
    assert warm_counters.get("cache_hits") == cold_counters["cache_misses"], warm_counters
    # a repeated layer's piece has the same bytes: loaded once, then reused (SmolLM2's 30 layers)
    served = warm_counters.get("artifacts_loaded", 0) + warm_counters.get("artifacts_reused", 0)
    assert served == cold_counters["artifacts_saved"], warm_counters
    assert warm_counters.get("artifacts_loaded", 0) >= 1, warm_counters
    assert not warm_counters.get("cache_misses") and not warm_counters.get("pieces_compiled")
    assert warm["warmup"]["compile_seconds"] < cold["warmup"]["compile_seconds"]


def test_level_change_rolls_out_while_a_client_keeps_sending(kubectl: Kubectl) -> None:
    url = service_url(kubectl)
    failures: list[str] = []
    done = [0]
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                greedy(url, max_tokens=4)
                done[0] += 1
            except Exception as exc:  # noqa: BLE001 - every failure counts
                failures.append(repr(exc))
            time.sleep(0.1)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        wait_for("requests flowing", lambda: done[0] >= 3, timeout=60)
        before = atomd(kubectl, NAME)["status"]["revision"]
        kubectl("patch", "atomd", NAME, "-n", NAMESPACE, "--type=merge",
                "-p", json.dumps({"spec": {"compilation": {"level": 1}}}))  # fmt: skip

        def rolled() -> bool:
            obj = atomd(kubectl, NAME)
            pods = runtime_pods(kubectl, NAME)
            return (is_ready(obj) and obj["status"]["revision"] != before and len(pods) == 1
                    and pod_ready(pods[0]) and status_of(pods[0])["level"] == 1)  # fmt: skip

        wait_for("the new revision to serve alone", rolled, timeout=READY_TIMEOUT)
        served = done[0]
        wait_for("requests served by the new revision", lambda: done[0] >= served + 3,
                 timeout=60)  # fmt: skip
    finally:
        stop.set()
        thread.join(60)
    # the old pod's preStop sleep kept it serving until kube-proxy stopped routing to it
    assert not failures, f"{len(failures)} of {done[0] + len(failures)} failed: {failures[:3]}"


PD_NAME = "tiny-cpu-pd"


def test_pd_on_real_pods_gives_the_unified_greedy_tokens(kubectl: Kubectl) -> None:
    unified_tokens = greedy(service_url(kubectl))
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"] = {"name": PD_NAME, "namespace": NAMESPACE}
    spec = manifest["spec"]
    spec.pop("replicas")
    spec["compilation"]["level"] = 1  # the unified one runs level 1 since the rollout test
    spec["disaggregation"] = {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                              "router": {"replicas": 1}}  # fmt: skip
    apply(kubectl, manifest)
    try:
        wait_for(
            "the P/D AtomDeployment to be Ready",
            lambda: is_ready(atomd(kubectl, PD_NAME)),
            timeout=READY_TIMEOUT,
        )  # fmt: skip
        for role in ("prefill", "decode", "router"):
            pods = runtime_pods(kubectl, PD_NAME, role)
            assert pods and all(p["spec"]["nodeName"] == "atom-node" for p in pods), role
        pd_tokens = greedy(service_url(kubectl, PD_NAME))
        assert pd_tokens == unified_tokens
    finally:
        kubectl("delete", "atomd", PD_NAME, "-n", NAMESPACE, "--wait=false", check=False)


def test_bad_model_path_turns_the_atomdeployment_degraded(kubectl: Kubectl) -> None:
    manifest = copy.deepcopy(EXAMPLE)
    manifest["metadata"] = {"name": "tiny-cpu-broken", "namespace": NAMESPACE}
    manifest["spec"]["model"] = {"path": "/models/missing", "name": MODEL,
                                 "loadFormat": "safetensors", "dtype": "float32"}  # fmt: skip
    manifest["spec"]["compileCache"] = {"enabled": False}
    apply(kubectl, manifest)
    try:

        def degraded() -> dict[str, Any] | None:
            conditions = {
                c["type"]: c
                for c in atomd(kubectl, "tiny-cpu-broken").get("status", {}).get("conditions") or []
            }
            c = conditions.get("Degraded")
            return c if c and c["status"] == "True" else None

        cond = wait_for("Degraded=True", degraded, timeout=300, interval=2)
        # the pod's own reason (CrashLoopBackOff, its exit) reaches the AtomDeployment
        assert "CrashLoop" in cond["reason"] + cond["message"], cond
    finally:
        kubectl("delete", "atomd", "tiny-cpu-broken", "-n", NAMESPACE, "--wait=false",
                check=False)  # fmt: skip


def test_deleting_the_atomdeployment_keeps_the_claim_and_its_files(
    real_cluster: Any, kubectl: Kubectl
) -> None:
    claim = atomd(kubectl, NAME)["status"]["compileCache"]["claimName"]
    pvc = kubectl.json("pvc", claim, "-n", NAMESPACE)
    pv = kubectl.json("pv", pvc["spec"]["volumeName"])
    directory = Path(pv["spec"]["hostPath"]["path"])
    files_before = sorted(p for p in directory.rglob("*") if p.is_file())
    assert files_before, f"the compile cache {directory} is empty"
    kubectl("delete", "atomd", NAME, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
    wait_for("the runtime pods to go", lambda: not runtime_pods(kubectl, NAME), timeout=180)
    assert kubectl.json("pvc", claim, "-n", NAMESPACE)["status"]["phase"] == "Bound"
    assert sorted(p for p in directory.rglob("*") if p.is_file()) == files_before
    print(f"\nstart times (s): {TIMES}")
