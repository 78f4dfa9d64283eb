"""Faults on the real node, against one prefill/decode AtomDeployment (1 prefill, 2 decode, the
router) of the tiny built-in model at level 3 with Inductor, its pieces on the compile-cache
claim. The tests run in file order and share it:

- kill -9 of a decode container mid-stream: the router ends the open stream with an in-band
  error event (no failover of a half-sent answer), new requests go to the other decode pod, and
  the killed container restarts in the same pod, warm from the claim;
- kill of the leader operator pod: the standby takes the Lease over and reconciles a spec change
  made after the kill (the time is printed);
- a corrupt artifact on the claim: a new pod recompiles that piece (counter cache_corrupt),
  serves, and does not crash-loop;
- `kubectl drain` of the node stops at the decode role's PodDisruptionBudget.

Run under the shared lock (one real node fits the machine):
  flock /tmp/atom-realnode.lock .venv/bin/pytest -q -x -p no:cacheprovider -n 0 \
      tests/realnode/test_faults_real.py
"""

from __future__ import annotations

import ast
import copy
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import faults_helpers as fh
import pytest
import realnode_helpers as rn

from atom_devtools.demo_real import OPERATOR_NAMESPACE, RELEASE
from atom_devtools.devcluster.realnode import NODE_NAME
from atom_devtools.kubectl import Kubectl, is_ready
from testutil import wait_for

pytestmark = [pytest.mark.realnode, pytest.mark.slow]

NAME = "faults-pd"
MODEL = "tiny-llama"
READY_TIMEOUT = 600
LONG = 1500  # tokens of the stream that is cut (seconds of decoding on the loaded CPU)
TIMES: dict[str, float] = {}
CACHE_INDEX_FILE = "vllm_compile_cache.py"  # atom.compilation.cache's (that import needs torch)


def manifest() -> dict[str, Any]:
    example = rn.EXAMPLE["spec"]
    return {
        "apiVersion": "atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": NAME, "namespace": rn.NAMESPACE},
        "spec": {
            "device": "cpu",
            "model": {"name": MODEL, "loadFormat": "dummy", "dtype": "float32"},
            "engine": {"maxNumSeqs": 4, "maxModelLen": 2048},
            # Inductor: its pieces are what the claim keeps for a warm restart
            "compilation": {"level": 3, "useInductor": True},
            "compileCache": {"size": "1Gi", "accessModes": ["ReadWriteOnce"]},
            "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 2},
                               "router": {"replicas": 1}},  # fmt: skip
            "resources": {"requests": {"cpu": "100m", "memory": "512Mi"},
                          "limits": {"memory": "2Gi"}},  # fmt: skip
            "nodeSelector": copy.deepcopy(example["nodeSelector"]),
            "tolerations": copy.deepcopy(example["tolerations"]),
        },
    }


def ready_role(kubectl: Kubectl, role: str, count: int) -> list[dict[str, Any]]:
    pods = rn.runtime_pods(kubectl, NAME, role)
    return pods if len(pods) == count and all(map(rn.pod_ready, pods)) else []


def all_ready(kubectl: Kubectl) -> bool:
    return bool(
        is_ready(rn.atomd(kubectl, NAME))
        and ready_role(kubectl, "prefill", 1)
        and ready_role(kubectl, "decode", 2)
        and ready_role(kubectl, "router", 1)
    )


def router_host(kubectl: Kubectl) -> str:
    """The AtomDeployment's Service (its ClusterIP; kube-proxy serves it on the host too)."""
    return str(kubectl.json("service", NAME, "-n", rn.NAMESPACE)["spec"]["clusterIP"])


def router_ip(kubectl: Kubectl) -> str:
    return str(rn.runtime_pods(kubectl, NAME, "router")[0]["status"]["podIP"])


def router_status(kubectl: Kubectl) -> dict[str, Any]:
    code, body = rn.http_json(f"http://{router_ip(kubectl)}:8000/status")
    assert code == 200, body
    return body


def in_rotation(kubectl: Kubectl, url: str) -> bool:
    decode = router_status(kubectl)["instances"]["decode"]
    return any(i["url"] == url and i["in_rotation"] and i["healthy"] for i in decode)


def counters_of(pod: dict[str, Any]) -> dict[str, int]:
    return dict(rn.status_of(pod)["warmup"]["counters"])


def requests_reach(kubectl: Kubectl, url: str, host: str) -> float:
    """Send concurrent streams through the router until one is decoded at `url` (the router
    balances decode by outstanding requests); the requests `url` answered."""
    before = fh.decode_requests(router_ip(kubectl)).get(url, 0.0)
    results: list[fh.StreamResult] = []

    def one() -> None:
        results.append(fh.stream_once(host, MODEL, 64))

    def reached() -> float:
        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        return fh.decode_requests(router_ip(kubectl)).get(url, 0.0) - before

    served = wait_for(f"a request decoded at {url}", reached, timeout=120, interval=1)
    bad = [r for r in results if r.errors or r.broken or not r.done]
    assert not bad, bad[:3]
    return served


@pytest.fixture(scope="module")
def pd(operator_release: str, kubectl: Kubectl) -> Iterator[str]:
    start = time.monotonic()
    rn.apply(kubectl, manifest())
    try:
        wait_for("the P/D AtomDeployment and its pods Ready", lambda: all_ready(kubectl),
                 timeout=READY_TIMEOUT, interval=1)  # fmt: skip
        TIMES["pd_cold_ready_s"] = time.monotonic() - start
        host = router_host(kubectl)
        assert fh.stream_once(host, MODEL, 8).done
        yield host
    finally:
        print(f"\nfault test times (s): { {k: round(v, 1) for k, v in TIMES.items()} }")
        kubectl("delete", "atomd", NAME, "-n", rn.NAMESPACE, "--wait=false", check=False)


def test_kill_9_of_a_decode_container_mid_stream(
    pd: str, kubectl: Kubectl, real_cluster: Any
) -> None:
    host = pd
    cold = {p["metadata"]["name"]: counters_of(p) for p in ready_role(kubectl, "decode", 2)}
    assert all(c.get("pieces_compiled", 0) > 0 or c.get("cache_hits", 0) > 0
               for c in cold.values()), cold  # fmt: skip
    stream = fh.Streamer(host, fh.completion_body(MODEL, LONG, stream=True))
    assert stream.resp.status == 200
    events = stream.events()
    for _ in range(3):  # the answer is flowing
        assert isinstance(next(events), dict)
    # the decode instance holding it, as the router sees it
    busy = [i for i in router_status(kubectl)["instances"]["decode"] if i["outstanding"] > 0]
    assert len(busy) == 1, busy
    victim_url = busy[0]["url"]
    decodes = ready_role(kubectl, "decode", 2)
    victim = next(p for p in decodes if fh.pod_url(p) == victim_url)
    survivor = next(p for p in decodes if p is not victim)
    before = fh.decode_requests(router_ip(kubectl))

    killed = time.monotonic()
    real_cluster.node.ctr("tasks", "kill", "-s", "SIGKILL", fh.container_id(victim, "runtime"))
    result = stream.finish()
    TIMES["stream_ended_after_kill_s"] = time.monotonic() - killed
    # A clean end: an OpenAI error event naming the instance (no address), then [DONE]; the
    # tokens already sent are not sent again elsewhere (no failover of a half-sent answer).
    assert not result.broken, result
    assert result.done and len(result.errors) == 1, result
    error = result.errors[0]
    assert error["code"] == "decode_failed", error
    assert "decode-" in error["message"] and "failed during the request" in error["message"]
    assert "10.245." not in error["message"], error
    assert 3 <= result.chunks < LONG, result
    assert TIMES["stream_ended_after_kill_s"] < 10

    # New requests: every one answered, by the surviving decode pod.
    for _ in range(4):
        again = fh.stream_once(host, MODEL, 8)
        assert again.done and not again.errors and not again.broken, again
    after = fh.decode_requests(router_ip(kubectl))
    assert after.get(victim_url, 0) == before.get(victim_url, 0), (before, after)
    survivor_url = fh.pod_url(survivor)
    assert after[survivor_url] - before.get(survivor_url, 0) == 4, (before, after)

    # The kubelet restarts the container in the same pod, which starts warm from the claim.
    def restarted() -> dict[str, Any] | None:
        pod = fh.pod_by_name(kubectl, rn.NAMESPACE, victim["metadata"]["name"])
        return pod if fh.restarts(pod) == 1 and rn.pod_ready(pod) else None

    pod = wait_for("the killed container Ready again", restarted, timeout=READY_TIMEOUT)
    TIMES["killed_decode_ready_again_s"] = time.monotonic() - killed
    assert pod["metadata"]["uid"] == victim["metadata"]["uid"]
    last = pod["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 137, last  # SIGKILL
    warm = counters_of(pod)
    assert warm.get("cache_hits", 0) > 0 and warm.get("artifacts_loaded", 0) > 0, warm
    assert not warm.get("pieces_compiled") and not warm.get("cache_misses"), warm
    # ... and serves again through the router
    wait_for("the restarted decode back in rotation", lambda: in_rotation(kubectl, victim_url),
             timeout=60)  # fmt: skip
    assert requests_reach(kubectl, victim_url, host) > 0
    print(f"\nkill -9 mid-stream: the router ended the stream with decode_failed after "
          f"{result.chunks} chunks, {TIMES['stream_ended_after_kill_s']:.1f}s after the kill; "
          f"4/4 later requests on the survivor; warm restart {warm}")  # fmt: skip


def operator_pods(kubectl: Kubectl) -> list[dict[str, Any]]:
    pods = kubectl.json("pods", "-n", OPERATOR_NAMESPACE, "-l",
                        f"app.kubernetes.io/instance={RELEASE}")["items"]  # fmt: skip
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def lease_holder(kubectl: Kubectl) -> str:
    lease = kubectl.json("lease", RELEASE, "-n", OPERATOR_NAMESPACE)
    return str(lease["spec"].get("holderIdentity") or "")


def test_killing_the_leader_operator_hands_reconciles_to_the_standby(
    pd: str, kubectl: Kubectl, real_cluster: Any
) -> None:
    pods = wait_for(
        "two Ready operator pods",
        lambda: (lambda ps: ps if len(ps) == 2 and all(map(rn.pod_ready, ps)) else None)(
            operator_pods(kubectl)
        ),
        timeout=120,
    )
    leader = wait_for("a leader", lambda: lease_holder(kubectl), timeout=60)
    assert leader in {p["metadata"]["name"] for p in pods}, leader
    victim = next(p for p in pods if p["metadata"]["name"] == leader)
    standby = next(p for p in pods if p is not victim)["metadata"]["name"]

    # a client streams through the router throughout: the operator is not on the data path
    failures: list[fh.StreamResult] = []
    served = [0]
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            r = fh.stream_once(pd, MODEL, 16)
            if r.done and not r.errors and not r.broken:
                served[0] += 1
            else:
                failures.append(r)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    marker = f"t{int(time.time())}"
    try:
        # SIGKILL (no graceful release of the Lease), then the pod goes for good: its
        # restarted container would take the Lease back under the same pod name.
        killed = time.monotonic()
        real_cluster.node.ctr("tasks", "kill", "-s", "SIGKILL",
                              fh.container_id(victim, "operator"))  # fmt: skip
        kubectl("delete", "pod", leader, "-n", OPERATOR_NAMESPACE, "--grace-period=0", "--force",
                "--wait=false")  # fmt: skip
        # the spec change, made after the kill: only a new leader can reconcile it
        peer = {"podSelector": {"matchLabels": {"atom.dev/fault-test": marker}}}
        kubectl("patch", "atomd", NAME, "-n", rn.NAMESPACE, "--type=merge",
                "-p", json.dumps({"spec": {"networkPolicy": {"metricsFrom": [peer]}}}))  # fmt: skip

        def reconciled() -> bool:
            policies = kubectl.json("networkpolicies", "-n", rn.NAMESPACE, "-l",
                                    f"app.kubernetes.io/instance={NAME}")["items"]  # fmt: skip
            return marker in json.dumps(policies)

        wait_for("the spec change in the NetworkPolicies", reconciled, timeout=120, interval=0.25)
        TIMES["leader_takeover_to_reconcile_s"] = took = time.monotonic() - killed
        assert lease_holder(kubectl) == standby
        # the lease (15 s, by the standby's clock) + a renew period + the reconcile itself
        assert took < 35, f"the standby reconciled {took:.1f}s after the leader was killed"
        wait_for("requests flowing", lambda: served[0] >= 3, timeout=60)
    finally:
        stop.set()
        thread.join(60)
    assert not failures, failures[:3]
    print(f"\nleader operator killed: {standby} reconciled the next spec change after "
          f"{took:.1f}s; {served[0]} streams through the router meanwhile, 0 failed")  # fmt: skip


def claim_dir(kubectl: Kubectl) -> Path:
    claim = rn.atomd(kubectl, NAME)["status"]["compileCache"]["claimName"]
    volume = kubectl.json("pvc", claim, "-n", rn.NAMESPACE)["spec"]["volumeName"]
    return Path(kubectl.json("pv", volume)["spec"]["hostPath"]["path"])


def indexed_artifact(root: Path) -> Path:
    """An artifact file the compile-cache index points at (pods compiling at once may each
    have saved one; only the indexed one is ever loaded)."""
    for index in sorted(root.rglob(CACHE_INDEX_FILE)):
        entries = ast.literal_eval(index.read_text())
        for _key, (_name, filename, _digest) in sorted(entries.items(), key=repr):
            if (index.parent / filename).is_file():
                return index.parent / filename
    raise AssertionError(f"no indexed artifact under {root}")


def test_a_corrupt_cache_entry_is_recompiled_without_a_crash_loop(
    pd: str, kubectl: Kubectl
) -> None:
    target = indexed_artifact(claim_dir(kubectl))
    data = target.read_bytes()
    target.write_bytes(bytes(b ^ 0xFF for b in data[:64]) + data[64:])  # same size, new bytes

    old = ready_role(kubectl, "decode", 2)
    gone = old[0]
    start = time.monotonic()
    kubectl("delete", "pod", gone["metadata"]["name"], "-n", rn.NAMESPACE, "--wait=false")
    new = wait_for(
        "a new decode pod Ready",
        lambda: next((p for p in ready_role(kubectl, "decode", 2)
                      if p["metadata"]["uid"] not in {o["metadata"]["uid"] for o in old}), None),
        timeout=READY_TIMEOUT,
    )  # fmt: skip
    TIMES["corrupt_entry_pod_ready_s"] = time.monotonic() - start
    counters = counters_of(new)
    # the corrupt piece was detected and compiled again; the others still came from the claim
    assert counters.get("cache_corrupt", 0) >= 1, counters
    assert counters.get("pieces_compiled", 0) >= 1, counters
    assert counters.get("cache_hits", 0) >= 1, counters
    logs = kubectl("logs", "-n", rn.NAMESPACE, new["metadata"]["name"], "-c", "runtime").stdout
    assert "does not match its checksum" in logs and "recompiling" in logs, logs[-2000:]
    url = fh.pod_url(new)
    wait_for("the new decode in rotation", lambda: in_rotation(kubectl, url), timeout=60)
    assert requests_reach(kubectl, url, pd) > 0
    again = fh.pod_by_name(kubectl, rn.NAMESPACE, new["metadata"]["name"])
    assert fh.restarts(again) == 0 and rn.pod_ready(again), again["status"]
    print(f"\ncorrupt {target.name}: the new pod recompiled it ({counters}), Ready after "
          f"{TIMES['corrupt_entry_pod_ready_s']:.0f}s, no restart")  # fmt: skip


BUDGET = f"{NAME}-decode"
BUDGET_VIOLATION = "would violate the pod's disruption budget"


def disruptions_allowed(kubectl: Kubectl) -> int | None:
    pdb = kubectl.json("pdb", BUDGET, "-n", rn.NAMESPACE)
    return pdb.get("status", {}).get("disruptionsAllowed")


def test_a_node_drain_stops_at_the_disruption_budget(pd: str, kubectl: Kubectl) -> None:
    pods = wait_for("two Ready decode pods", lambda: ready_role(kubectl, "decode", 2), timeout=300)
    assert {p["spec"]["nodeName"] for p in pods} == {NODE_NAME}
    wait_for("the budget to allow one disruption", lambda: disruptions_allowed(kubectl) == 1,
             timeout=60)  # fmt: skip
    start = time.monotonic()
    selector = f"app.kubernetes.io/instance={NAME},atom.dev/role=decode"
    try:
        drain = kubectl("drain", NODE_NAME, f"--pod-selector={selector}", "--ignore-daemonsets",
                        "--delete-emptydir-data", "--timeout=15s", check=False,
                        timeout=120)  # fmt: skip
        TIMES["drain_refused_s"] = time.monotonic() - start
        said = drain.stdout + drain.stderr
        # one pod went; the other was refused for the whole timeout: its replacement cannot
        # schedule on the cordoned node, so the budget never allows a second disruption
        assert drain.returncode != 0 and BUDGET_VIOLATION in said, said
        assert kubectl.json("node", NODE_NAME)["spec"].get("unschedulable") is True
        names = {p["metadata"]["name"] for p in pods}
        left = rn.runtime_pods(kubectl, NAME, "decode")
        kept = [p for p in left if p["metadata"]["name"] in names]
        assert len(kept) == 1 and rn.pod_ready(kept[0]), [p["metadata"]["name"] for p in left]
        assert disruptions_allowed(kubectl) == 0
        # the Eviction API itself answers 429 for the last Ready pod
        name = kept[0]["metadata"]["name"]
        eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                    "metadata": {"name": name, "namespace": rn.NAMESPACE}}  # fmt: skip
        refused = kubectl("create", "--raw",
                          f"/api/v1/namespaces/{rn.NAMESPACE}/pods/{name}/eviction", "-f", "-",
                          input=json.dumps(eviction), check=False)  # fmt: skip
        assert refused.returncode != 0, refused.stdout
        assert "TooManyRequests" in refused.stderr and BUDGET_VIOLATION in refused.stderr
        assert rn.pod_ready(kubectl.json("pod", name, "-n", rn.NAMESPACE))
        # the router kept serving on the pod the budget protected
        assert fh.stream_once(pd, MODEL, 8).done
    finally:
        kubectl("uncordon", NODE_NAME)
    # uncordoned: the replacement schedules, and the budget allows one disruption again
    wait_for("two Ready decode pods again", lambda: ready_role(kubectl, "decode", 2),
             timeout=READY_TIMEOUT)  # fmt: skip
    wait_for("the budget to recover", lambda: disruptions_allowed(kubectl) == 1, timeout=60)
    wait_for("the AtomDeployment Ready", lambda: is_ready(rn.atomd(kubectl, NAME)), timeout=60)
    TIMES["drain_recovered_s"] = time.monotonic() - start
    print(f"\ndrain refused after {TIMES['drain_refused_s']:.0f}s; recovered "
          f"{TIMES['drain_recovered_s']:.0f}s after the drain began")  # fmt: skip
