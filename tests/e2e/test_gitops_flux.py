"""GitOps with the real Flux: source-controller and kustomize-controller (the flux addon) follow
a Git repository on the local Git server and apply AtomDeployments to the real API server,
where the operator (a local process) rolls them out on kwok GPU nodes.

The GitRepository and Kustomization are the ones docs/gitops.md shows (read out of it); the
Kustomization `models` checks health with the doc's healthCheckExprs, `models-wait` is the same
with `wait: true` alone (kstatus). The tests build on each other, in order: one Flux, one Git
server, one operator for the module.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from atomd_e2e import Kubectl, OperatorProcess, condition, dump, get, is_ready, running_operator
from gitops_health import flux_manifests

from atom_devtools.devcluster import addons
from atom_devtools.devcluster.flux import Flux, running
from atom_devtools.devcluster.fluxrepo import FluxRepo, revision_of
from atom_devtools.devcluster.gitserver import Checkout, GitServer
from atom_operator import naming
from atom_operator.kube import FIELD_MANAGER, Kube
from testutil import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NS = "atom-gitops"
READY_TIMEOUT = 120
FLUX_MANAGER = "kustomize-controller"  # Flux's server-side apply field manager


def _spec(mode: str = "FULL_AND_TR_HYBRID", **extra: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "tiny-llama", "loadFormat": "dummy"},
        "engine": {"maxNumSeqs": 16},
        "compilation": {"level": 3, "cudagraphMode": mode, "cudagraphCaptureSizes": [1, 2, 4, 8]},
        "compileCache": {"size": "1Gi", "accessModes": ["ReadWriteMany"]},
        "disaggregation": {"prefill": {"replicas": 1}, "decode": {"replicas": 1},
                           "router": {"replicas": 1}},
        "resources": {"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}},
    }
    spec.update(extra)
    return spec


def _manifest(name: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump({"apiVersion": "atom.dev/v1alpha1", "kind": "AtomDeployment",
                           "metadata": {"name": name, "namespace": NS}, "spec": spec})


@pytest.fixture(scope="module")
def flux(cluster) -> Iterator[Flux]:
    try:
        addons.wait_installed("flux")
    except addons.AddonError as exc:
        pytest.fail(str(exc), pytrace=False)
    with running(cluster.kubeconfig) as flux:
        procs = list(flux.procs)
        yield flux
    # torn down with nothing left: no controller process, no working directory
    assert not any(p.alive for p in procs) and not flux.workdir.exists()


@pytest.fixture(scope="module")
def operator(kubectl: Kubectl, env: dict[str, str], tmp_path_factory) -> Iterator[OperatorProcess]:
    with running_operator(kubectl, env, tmp_path_factory.mktemp("operator"), NS) as op:
        yield op


@pytest.fixture(scope="module")
def repo(flux: Flux, operator, kubectl: Kubectl, tmp_path_factory) -> Iterator[FluxRepo]:
    git_repo, models = flux_manifests()
    with GitServer() as server:
        url = server.create(git_repo["metadata"]["name"])
        checkout = Checkout(url, tmp_path_factory.mktemp("git") / "platform")
        repo = FluxRepo(kubectl, checkout, git_repo["metadata"]["name"])
        checkout.commit({"README.md": "models for the local cluster\n"}, "empty platform")
        wait = copy.deepcopy(models)
        wait["metadata"]["name"], wait["spec"]["path"] = "models-wait", "./wait"
        del wait["spec"]["healthCheckExprs"]
        git_repo["spec"]["url"] = url
        kubectl.apply([git_repo, models, wait])
        try:
            yield repo
        finally:
            # prune: true deletes what they applied (and the operator collects the children)
            kubectl("delete", "kustomization", "--all", "-n", "flux-system", "--wait=true",
                    "--timeout=60s", check=False)
            kubectl("delete", "gitrepository", "--all", "-n", "flux-system", check=False)


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What one test leaves for the next (revisions, commits)."""
    return {}


def _ready_at(obj: dict[str, Any]) -> str:
    return condition(obj, "Ready")["lastTransitionTime"]


def test_commit_applies_and_kustomization_is_ready_only_after_the_atomdeployment(
    repo: FluxRepo, kube: Kube, operator: OperatorProcess, state: dict[str, Any]
) -> None:
    # The operator is down while Flux applies: the new objects have no status yet.
    operator.stop()
    sha = repo.push({"models/pd.yaml": _manifest("pd", _spec()),
                     "wait/pd-wait.yaml": _manifest("pd-wait", _spec())},
                    "add disaggregated AtomDeployments")
    # `wait: true` alone: kstatus calls an object without status Current, so the
    # Kustomization is Ready before the operator has even seen the AtomDeployment.
    early = repo.wait_done("models-wait", sha)
    assert condition(early, "Ready")["status"] == "True", dump(early["status"])
    assert "status" not in get(kube, NS, "pd-wait")
    # The published healthCheckExprs: in progress until the operator says Ready.
    waiting = wait_for("models running its health checks", lambda: (lambda ks: ks if (
        ks["status"].get("lastAttemptedRevision") == revision_of(sha)
        and "health checks" in condition(ks, "Reconciling").get("message", "")) else None)(
        repo.get("kustomization", "models")), timeout=60)
    assert condition(waiting, "Ready")["status"] == "Unknown", dump(waiting["status"])
    operator.start()
    done = repo.wait_done("models", sha, timeout=READY_TIMEOUT)
    assert condition(done, "Ready")["status"] == "True", dump(done["status"])
    assert done["status"]["lastAppliedRevision"] == revision_of(sha)
    obj = get(kube, NS, "pd")
    # Ready at the generation Flux applied, and no later than Flux said so
    assert is_ready(obj), dump(obj["status"])
    assert _ready_at(obj) <= _ready_at(done), (_ready_at(obj), _ready_at(done))
    wait_for("pd-wait Ready", lambda: is_ready(get(kube, NS, "pd-wait")), timeout=READY_TIMEOUT)
    state["revision"] = obj["status"]["revision"]
    state["good"] = sha


def _router_revisions(kube: Kube, name: str) -> tuple[str, str]:
    router = kube.get("Deployment", NS, f"{name}-router")
    assert router is not None, f"{name}-router missing"
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    pre, dec = args[args.index("--prefill") + 1], args[args.index("--decode") + 1]
    return (pre.split(f"{name}-prefill-")[1].split(".")[0],
            dec.split(f"{name}-decode-")[1].split(".")[0])


def test_graph_mode_commit_rolls_out_in_lock_step(
    repo: FluxRepo, kube: Kube, state: dict[str, Any], record_property
) -> None:
    old = state["revision"]
    pushed = time.monotonic()
    sha = repo.push({"models/pd.yaml": _manifest("pd", _spec("FULL_DECODE_ONLY")),
                     "wait/pd-wait.yaml": _manifest("pd-wait", _spec("FULL_DECODE_ONLY"))},
                    "pd, pd-wait: FULL_DECODE_ONLY")
    seen: dict[str, list[str]] = {"models": [], "models-wait": []}
    ready_after: dict[str, float] = {}

    def rolled_out() -> bool:
        for name in ("pd", "pd-wait"):
            pre, dec = _router_revisions(kube, name)
            assert pre == dec, (name, pre, dec)  # never serving two revisions
        for ks_name, states in seen.items():
            ks = repo.get("kustomization", ks_name)
            ready = condition(ks, "Ready")
            if ks["status"].get("lastAttemptedRevision") != revision_of(sha):
                continue
            state_now = "Ready" if ready.get("status") == "True" else ready.get("reason", "")
            if not states or states[-1] != state_now:
                states.append(state_now)
            if state_now == "Ready" and ks_name not in ready_after:
                ready_after[ks_name] = time.monotonic() - pushed
        return len(ready_after) == 2

    wait_for("both Kustomizations Ready at the graph-mode commit", rolled_out,
             timeout=READY_TIMEOUT, interval=0.1)
    record_property("push_to_ready_s", {k: round(v, 1) for k, v in ready_after.items()})
    print(f"graph-mode commit: push to Kustomization Ready {ready_after}")
    for ks_name, name in (("models", "pd"), ("models-wait", "pd-wait")):
        ks = repo.get("kustomization", ks_name)
        obj = get(kube, NS, name)
        assert is_ready(obj), (name, dump(obj["status"]))
        assert _ready_at(obj) <= _ready_at(ks), (ks_name, _ready_at(obj), _ready_at(ks))
        assert seen[ks_name][0] == "Progressing" and seen[ks_name][-1] == "Ready", seen
        assert _router_revisions(kube, name) == (obj["status"]["revision"],) * 2
    new = get(kube, NS, "pd")["status"]["revision"]
    assert new != old
    state.update(mode_commit=sha, new_revision=new)


def test_no_drift_on_the_next_reconciles(
    repo: FluxRepo, kube: Kube, kubectl: Kubectl, flux: Flux, state: dict[str, Any]
) -> None:
    before = get(kube, NS, "pd")
    log_start = flux.log("kustomize-controller").stat().st_size
    for _ in range(2):
        ks = repo.reconcile_again("models")
        assert condition(ks, "Ready")["status"] == "True", dump(ks["status"])
    after = get(kube, NS, "pd")
    assert after["metadata"]["generation"] == before["metadata"]["generation"]
    assert after["spec"] == before["spec"]
    # The commit's manifest as Flux applies it (plus the labels it adds), diffed server-side
    # under Flux's field manager: nothing would change
    manifest = yaml.safe_load((repo.checkout.path / "models" / "pd.yaml").read_text())
    manifest["metadata"]["labels"] = {"kustomize.toolkit.fluxcd.io/name": "models",
                                      "kustomize.toolkit.fluxcd.io/namespace": "flux-system"}
    diff = kubectl("diff", "--server-side", f"--field-manager={FLUX_MANAGER}", "-f", "-",
                   input=yaml.safe_dump(manifest), check=False)
    assert diff.returncode == 0 and not diff.stdout, diff.stdout
    with flux.log("kustomize-controller").open() as log:
        log.seek(log_start)
        text = log.read()
    assert "conflict" not in text.lower(), text[-2000:]
    assert "AtomDeployment/atom-gitops/pd" in text and "unchanged" in text, text[-2000:]
    # the operator owns no spec field: only Flux does
    owners = {m["manager"]: m.get("fieldsV1", {}) for m in after["metadata"]["managedFields"]}
    assert "f:spec" in owners[FLUX_MANAGER]
    assert all("f:spec" not in fields for manager, fields in owners.items()
               if manager != FLUX_MANAGER), dump(after["metadata"]["managedFields"])
    assert FIELD_MANAGER not in owners or "f:spec" not in owners[FIELD_MANAGER]


BAD_COMMITS = {
    "graph mode on device cpu": (
        {"models/pd.yaml": _manifest("pd", _spec("FULL_DECODE_ONLY", device="cpu"))},
        "device cpu runs no CUDA graphs",
    ),
    "capture sizes out of range": (
        {"models/pd.yaml": _manifest("pd", {**_spec("FULL_DECODE_ONLY"), "compilation": {
            "level": 3, "cudagraphMode": "FULL_DECODE_ONLY", "cudagraphCaptureSizes": [1, 64]}})},
        "must be at most engine.maxNumSeqs",
    ),
    "a 64-character name": (
        {"models/long.yaml": _manifest("m" * 64, _spec())},
        "metadata.name must be at most 63 characters",
    ),
}


def test_bad_commits_report_the_api_servers_message_and_keep_serving(
    repo: FluxRepo, kube: Kube, state: dict[str, Any]
) -> None:
    running = get(kube, NS, "pd")
    good = state["mode_commit"]
    for case, (files, message) in BAD_COMMITS.items():
        sha = repo.push(files, f"bad: {case}")
        ks = repo.wait_done("models", sha)
        ready = condition(ks, "Ready")
        assert ready["status"] == "False" and message in ready["message"], (case, ready)
        assert ks["status"]["lastAppliedRevision"] == revision_of(good), case
        now = get(kube, NS, "pd")
        assert now["metadata"]["generation"] == running["metadata"]["generation"], case
        assert is_ready(now) and now["status"]["revision"] == running["status"]["revision"]
        good = repo.revert(sha)
        ks = repo.wait_done("models", good)
        assert condition(ks, "Ready")["status"] == "True", (case, dump(ks["status"]))
    print(f"bad commit message on the Kustomization: {ready['message']}")


def test_git_revert_rolls_back_to_the_previous_revision(
    repo: FluxRepo, kube: Kube, state: dict[str, Any]
) -> None:
    sha = repo.revert(state["mode_commit"])
    ks = repo.wait_done("models", sha, timeout=READY_TIMEOUT)
    assert condition(ks, "Ready")["status"] == "True", dump(ks["status"])
    obj = get(kube, NS, "pd")
    assert is_ready(obj) and obj["status"]["revision"] == state["revision"], dump(obj["status"])
    assert _router_revisions(kube, "pd") == (state["revision"],) * 2


def _hpa_condition(kube: Kube, kind: str) -> dict[str, Any]:
    hpa = kube.get("HorizontalPodAutoscaler", NS, "one") or {}
    return condition(hpa, kind)


def test_hpa_owns_replicas_and_flux_does_not_fight(
    repo: FluxRepo, kube: Kube, kubectl: Kubectl
) -> None:
    unified = {k: v for k, v in _spec().items() if k != "disaggregation"}  # no replicas in Git
    hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
           "metadata": {"name": "one", "namespace": NS},
           "spec": {"scaleTargetRef": {"apiVersion": "atom.dev/v1alpha1",
                                       "kind": "AtomDeployment", "name": "one"},
                    "minReplicas": 2, "maxReplicas": 3,
                    "metrics": [{"type": "Resource", "resource": {
                        "name": "cpu", "target": {"type": "Utilization",
                                                  "averageUtilization": 80}}}]}}
    sha = repo.push({"models/one.yaml": _manifest("one", unified),
                     "models/one-hpa.yaml": yaml.safe_dump(hpa)}, "one: unified, with an HPA")
    repo.wait_done("models", sha, timeout=READY_TIMEOUT)
    # With spec.replicas unset the scale subresource cannot be read: the HPA cannot scale
    try:
        wait_for("the HPA reports it cannot read the scale",
                 lambda: "does not exist" in _hpa_condition(kube, "AbleToScale").get("message", ""),
                 timeout=60)
    except AssertionError as exc:
        raise AssertionError(dump(kube.get("HorizontalPodAutoscaler", NS, "one"))) from exc
    assert "replicas" not in get(kube, NS, "one")["spec"]
    # set once by hand, outside Git (kubectl scale reads the scale first, so a patch); below
    # minReplicas the HPA then scales without metrics (there is no metrics server here)
    kubectl("patch", "atomd", "one", "-n", NS, "--type=merge", "--field-manager=platform",
            "-p", '{"spec":{"replicas":1}}')
    wait_for("the HPA scaled one to 2", lambda: get(kube, NS, "one")["spec"].get("replicas") == 2,
             timeout=60)
    for _ in range(2):
        repo.reconcile_again("models")
        assert get(kube, NS, "one")["spec"]["replicas"] == 2
    wait_for("the operator follows: one-unified has 2 replicas", lambda: (
        (kube.get("Deployment", NS, "one-unified") or {}).get("spec", {}).get("replicas") == 2),
        timeout=60)
    owners = [m["manager"] for m in get(kube, NS, "one")["metadata"]["managedFields"]
              if "f:replicas" in str(m.get("fieldsV1", {}).get("f:spec", {}))]
    assert FLUX_MANAGER not in owners, owners


def test_prune_deletes_the_atomdeployment_its_children_and_the_claim_as_specified(
    repo: FluxRepo, kube: Kube
) -> None:
    dropped = _spec(compileCache={"size": "1Gi", "accessModes": ["ReadWriteMany"],
                                  "retainOnDelete": False})
    sha = repo.push({"models/dropped.yaml": _manifest("dropped", dropped)}, "dropped: add")
    assert condition(repo.wait_done("models", sha, timeout=READY_TIMEOUT),
                     "Ready")["status"] == "True"
    for name in ("pd", "dropped"):
        assert kube.get("PersistentVolumeClaim", NS, naming.pvc_name(name)) is not None, name
    sha = repo.push({"models/pd.yaml": None, "models/dropped.yaml": None}, "remove pd, dropped")
    assert condition(repo.wait_done("models", sha), "Ready")["status"] == "True"
    for name in ("pd", "dropped"):
        wait_for(f"{name} and its children gone", lambda name=name: (
            kube.get("AtomDeployment", NS, name) is None
            and not kube.list("Deployment", NS, naming.instance_selector(name))
            and not kube.list("Service", NS, naming.instance_selector(name))), timeout=60)
    wait_for("dropped's claim deleted (retainOnDelete: false)",
             lambda: kube.get("PersistentVolumeClaim", NS, naming.pvc_name("dropped")) is None,
             timeout=60)
    kept = kube.get("PersistentVolumeClaim", NS, naming.pvc_name("pd"))
    assert kept is not None and not kept["metadata"].get("deletionTimestamp")
