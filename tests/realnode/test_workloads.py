"""AtomDeployments whose runtime pods really run (CPU, tiny model) on the real node.

The tests run in file order and share one unified AtomDeployment: cold start (the startup
probe holds the pod un-Ready through compile), rollout under load, warm start from the
compile cache on the PVC, P/D against it, and finally its deletion (the claim stays).
"""

from __future__ import annotations

import copy
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from realnode_helpers import NAMESPACE, ROOT, http_json, wait_for

from atom_devtools.demo import Kubectl, is_ready

pytestmark = [pytest.mark.realnode, pytest.mark.slow]

EXAMPLE = yaml.safe_load((ROOT / "examples" / "atomdeployment-cpu.yaml").read_text())
NAME = EXAMPLE["metadata"]["name"]
MODEL = EXAMPLE["spec"]["model"]["name"]
PROMPT = "The capital of France is"
READY_TIMEOUT = 600
TIMES: dict[str, float] = {}


def apply(kubectl: Kubectl, manifest: dict[str, Any]) -> None:
    kubectl("apply", "-n", NAMESPACE, "-f", "-", input=json.dumps(manifest))


def atomd(kubectl: Kubectl, name: str = NAME) -> dict[str, Any]:
    return kubectl.json("atomd", name, "-n", NAMESPACE)


def runtime_pods(kubectl: Kubectl, name: str = NAME, role: str = "unified") -> list[dict]:
    selector = f"app.kubernetes.io/instance={name},atom.dev/role={role}"
    pods = kubectl.json("pods", "-n", NAMESPACE, "-l", selector)["items"]
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod["status"].get("conditions", []))  # fmt: skip


def status_of(pod: dict[str, Any]) -> dict[str, Any]:
    code, body = http_json(f"http://{pod['status']['podIP']}:8000/status")
    assert code == 200, body
    return body


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
    return manifest


def test_startup_probe_holds_the_pod_until_compile_is_done(
    unified: dict[str, Any], kubectl: Kubectl
) -> None:
    applied = time.monotonic()
    apply(kubectl, unified)
    seen_unready_503 = []

    def progress() -> bool:
        pods = runtime_pods(kubectl)
        if not pods or not pods[0]["status"].get("podIP"):
            return False
        pod = pods[0]
        code, body = http_json(f"http://{pod['status']['podIP']}:8000/health", timeout=2)
        if code == 503 and not pod_ready(pod) and not is_ready(atomd(kubectl)):
            seen_unready_503.append(body)
        return pod_ready(pod) and is_ready(atomd(kubectl))

    wait_for("the unified pod and atomd to be Ready", progress, READY_TIMEOUT, every=0.5)
    TIMES["cold_ready_s"] = time.monotonic() - applied
    # /health said 503 while the pod ran un-Ready: the startup probe gated it through compile
    assert seen_unready_503, "never saw the pod running but un-Ready with /health 503"
    status = status_of(runtime_pods(kubectl)[0])
    assert status["device"] == "cpu" and status["level"] == 3 and status["mode"] == "NONE"
    TIMES["cold_compile_s"] = status["warmup"]["compile_seconds"]
    TIMES["cold_warmup_s"] = status["warmup"]["warmup_seconds"]
    assert greedy(service_url(kubectl))
    print(f"\ncold start: {TIMES}")


def test_deleted_pod_comes_back_warm_from_the_pvc_cache(kubectl: Kubectl) -> None:
    old = runtime_pods(kubectl)[0]
    cold = status_of(old)
    start = time.monotonic()
    kubectl("delete", "pod", "-n", NAMESPACE, old["metadata"]["name"], "--wait=false")
    pod = wait_for("a new Ready pod", lambda: next(
        (p for p in runtime_pods(kubectl)
         if p["metadata"]["uid"] != old["metadata"]["uid"] and pod_ready(p)), None),
        READY_TIMEOUT)  # fmt: skip
    TIMES["warm_ready_s"] = time.monotonic() - start
    warm = status_of(pod)
    TIMES["warm_compile_s"] = warm["warmup"]["compile_seconds"]
    TIMES["warm_warmup_s"] = warm["warmup"]["warmup_seconds"]
    print(f"\ncold vs warm start: {TIMES}")
    assert warm["cache_key"] == cold["cache_key"]  # the same directory on the same claim
    if warm["counters"].get("dynamo_traces_loaded", 0) == 0 and not warm["counters"].get(
        "cache_hits"
    ):
        # Measured: `atom-runtime warmup` twice on one cache dir on the host gives the same
        # counters (cache_misses 3, no trace loaded) at level 3 with use_inductor false.
        pytest.xfail(
            "no warm start on CPU without Inductor: the runtime saves no Dynamo trace or "
            f"artifact then (warm counters {warm['counters']}); a CPU image with a C++ "
            "toolchain (Inductor) is needed for a real warm start"
        )
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
        wait_for("requests flowing", lambda: done[0] >= 3, 60)
        before = atomd(kubectl)["status"]["revision"]
        kubectl("patch", "atomd", NAME, "-n", NAMESPACE, "--type=merge",
                "-p", json.dumps({"spec": {"compilation": {"level": 1}}}))  # fmt: skip

        def rolled() -> bool:
            obj = atomd(kubectl)
            pods = runtime_pods(kubectl)
            return (is_ready(obj) and obj["status"]["revision"] != before and len(pods) == 1
                    and pod_ready(pods[0]) and status_of(pods[0])["level"] == 1)  # fmt: skip

        wait_for("the new revision to serve alone", rolled, READY_TIMEOUT)
        served_before_stop = done[0]
        time.sleep(2)
    finally:
        stop.set()
        thread.join(60)
    assert done[0] > served_before_stop or done[0] > 10
    if failures:
        template = kubectl.json("deployment", f"{NAME}-unified", "-n", NAMESPACE)["spec"][
            "template"
        ]
        if "preStop" not in json.dumps(template):
            pytest.xfail(
                f"{len(failures)} of {done[0] + len(failures)} failed ({failures[0]}): the pods have "
                "no preStop sleep yet (branch `operator` renders it), so kube-proxy still routes "
                "to a pod that stopped listening"
            )
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
        wait_for("the P/D AtomDeployment to be Ready",
                 lambda: is_ready(atomd(kubectl, PD_NAME)), READY_TIMEOUT)  # fmt: skip
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

        try:
            cond = wait_for("Degraded=True", degraded, 300, every=2)
        except AssertionError:
            pods = runtime_pods(kubectl, "tiny-cpu-broken")
            waiting = [s.get("state", {}).get("waiting", {}) for p in pods
                       for s in p["status"].get("containerStatuses", [])]  # fmt: skip
            if any(w.get("reason") == "CrashLoopBackOff" for w in waiting):
                pytest.xfail(
                    "the pod crash-loops but the operator's status does not report it "
                    "yet (status work of branch `operator`)"
                )
            raise
        # the pod's own reason (CrashLoopBackOff, its exit) reaches the AtomDeployment
        assert "CrashLoop" in cond["reason"] + cond["message"], cond
    finally:
        kubectl("delete", "atomd", "tiny-cpu-broken", "-n", NAMESPACE, "--wait=false",
                check=False)  # fmt: skip


def test_deleting_the_atomdeployment_keeps_the_claim_and_its_files(
    real_cluster: Any, kubectl: Kubectl
) -> None:
    claim = atomd(kubectl)["status"]["compileCache"]["claimName"]
    pvc = kubectl.json("pvc", claim, "-n", NAMESPACE)
    pv = kubectl.json("pv", pvc["spec"]["volumeName"])
    directory = Path(pv["spec"]["hostPath"]["path"])
    files_before = sorted(p for p in directory.rglob("*") if p.is_file())
    assert files_before, f"the compile cache {directory} is empty"
    kubectl("delete", "atomd", NAME, "-n", NAMESPACE, "--wait=true", "--timeout=120s")
    wait_for("the runtime pods to go", lambda: not runtime_pods(kubectl), 180)
    assert kubectl.json("pvc", claim, "-n", NAMESPACE)["status"]["phase"] == "Bound"
    assert sorted(p for p in directory.rglob("*") if p.is_file()) == files_before
    print(f"\nstart times (s): {TIMES}")
