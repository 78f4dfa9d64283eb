"""Every manifest in examples/ reaches Ready under the real operator on the local cluster.

The operator runs as a local process (`python -m atom_operator.main`), authenticated as the
chart's ServiceAccount with the chart's RBAC, so these tests also prove the chart grants the
operator everything it uses. kwok marks the runtime pods Ready; no image runs.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from atom_devtools.kubectl import Kubectl, install_crd, is_ready, wait_ready
from atom_devtools.localprocs import LocalOperator
from testutil import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "atom-operator"
# The CPU example selects the real node (tests/realnode runs it); kwok nodes cannot take it.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.yaml") if p.name != "atomdeployment-cpu.yaml")
NAMESPACE = "atom-e2e-examples"
RELEASE = "atom-e2e"
SA_NAME = RELEASE + "-atom-operator"
READY_TIMEOUT = 180
# How a GitOps tool applies: server-side, under its own field manager.
GITOPS_APPLY = (
    "apply", "--server-side", "--field-manager=gitops", "--force-conflicts", "-n", NAMESPACE
)


def atomdeployments(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] == "AtomDeployment"]


def helm_bin() -> str | None:
    from atom_devtools.devcluster.cache import HELM

    return str(HELM.path()) if HELM.is_installed() else None


def sa_kubeconfig(kubectl: Kubectl, admin_kubeconfig: str, out: Path) -> Path:
    """A kubeconfig for the chart's ServiceAccount: same server and CA, the SA's token."""
    token = kubectl("create", "token", SA_NAME, "-n", NAMESPACE, "--duration=2h").stdout.strip()
    config = yaml.safe_load(Path(admin_kubeconfig).read_text())
    for user in config["users"]:
        user["user"] = {"token": token}
    out.write_text(yaml.safe_dump(config))
    return out


@pytest.fixture(scope="module")
def kubectl(cluster) -> Kubectl:
    return Kubectl(cluster.env())


@pytest.fixture(scope="module")
def operator(cluster, kubectl: Kubectl, tmp_path_factory) -> Iterator[LocalOperator]:
    helm = helm_bin()
    if helm is None:
        pytest.skip("helm is not installed (run hack/controlplane install)")
    install_crd(kubectl)
    kubectl("create", "namespace", NAMESPACE, check=False)
    # The chart's ServiceAccount and RBAC only: its Deployment would be a kwok pretend pod.
    manifest = subprocess.run(
        [
            helm, "template", RELEASE, str(CHART), "-n", NAMESPACE,
            "--set", "scope=namespaced",
            "--show-only", "templates/serviceaccount.yaml",
            "--show-only", "templates/rbac.yaml",
        ],
        capture_output=True, text=True, check=True, env=kubectl.env,
    ).stdout  # fmt: skip
    kubectl("apply", "-n", NAMESPACE, "-f", "-", input=manifest)
    workdir = tmp_path_factory.mktemp("operator")
    config = sa_kubeconfig(kubectl, cluster.kubeconfig, workdir / "sa.kubeconfig")
    env = dict(cluster.env(), KUBECONFIG=str(config))
    with LocalOperator(env, workdir / "operator.log", namespaces=[NAMESPACE]) as running:
        yield running
        # Delete while the operator still runs, so nothing is left waiting on it.
        kubectl(
            "delete", "atomd", "--all", "-n", NAMESPACE, "--wait=true", "--timeout=60s", check=False
        )
    kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
    kubectl("delete", "-f", "-", "--ignore-not-found", input=_cluster_scoped(manifest), check=False)


def _cluster_scoped(manifest: str) -> str:
    docs = [d for d in yaml.safe_load_all(manifest) if d and d["kind"].startswith("Cluster")]
    return yaml.safe_dump_all(docs)


def test_examples_exist() -> None:
    names = {p.name for p in EXAMPLES}
    assert {
        "atomdeployment.yaml",
        "disaggregated.yaml",
        "decode-full-decode-only.yaml",
        "custom-capture-sizes.yaml",
    } <= names
    for path in EXAMPLES:
        text = path.read_text()
        assert text.lstrip().startswith("#"), (
            f"{path.name} should open with a comment saying what it shows"
        )
        assert atomdeployments(path), f"{path.name} has no AtomDeployment"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_reaches_ready(operator: LocalOperator, kubectl: Kubectl, example: Path) -> None:
    kubectl("apply", "--server-side", "--field-manager=e2e", "-n", NAMESPACE, "-f", str(example))
    for manifest in atomdeployments(example):
        name = manifest["metadata"]["name"]
        try:
            obj = wait_ready(kubectl, name, NAMESPACE, timeout=READY_TIMEOUT)
        except TimeoutError as error:
            raise AssertionError(f"{error}\noperator log:\n{operator.log_tail(60)}") from error
        assert obj["status"]["phase"] == "Ready"
        disaggregated = "disaggregation" in manifest["spec"]
        expected_roles = {"prefill", "decode", "router"} if disaggregated else {"unified"}
        selector = f"app.kubernetes.io/instance={name}"
        deployments = kubectl.json("deployments", "-n", NAMESPACE, "-l", selector)["items"]
        roles = {d["metadata"]["labels"]["atom.dev/role"] for d in deployments}
        assert roles == expected_roles
        for deployment in deployments:
            owners = deployment["metadata"].get("ownerReferences", [])
            assert [o["kind"] for o in owners] == ["AtomDeployment"]
            assert deployment["status"].get("readyReplicas", 0) == deployment["spec"]["replicas"]
    denied = [
        line for line in operator.log_path.read_text().splitlines() if "forbidden" in line.lower()
    ]
    assert not denied, "the chart's RBAC denied the operator:\n" + "\n".join(denied[:5])


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_gitops_health_checks_on_live_objects(
    operator: LocalOperator, kubectl: Kubectl, example: Path
) -> None:
    """The Argo CD check of docs/gitops.md calls a Ready AtomDeployment healthy (Flux's run in
    the real Flux: test_gitops_flux.py)."""
    pytest.importorskip("lupa", reason="lupa runs the Argo CD Lua check")
    from gitops_health import argo_health

    for manifest in atomdeployments(example):
        obj = kubectl.json("atomd", manifest["metadata"]["name"], "-n", NAMESPACE)
        if not is_ready(obj):
            pytest.skip(f"depends on test_example_reaches_ready[{example.stem}]")
        assert argo_health(obj)[0] == "Healthy", argo_health(obj)


def test_shared_claim_is_used_not_created(operator: LocalOperator, kubectl: Kubectl) -> None:
    example = ROOT / "examples" / "custom-capture-sizes.yaml"
    (manifest,) = atomdeployments(example)
    name = manifest["metadata"]["name"]
    claim = manifest["spec"]["compileCache"]["existingClaim"]
    obj = kubectl.json("atomd", name, "-n", NAMESPACE)
    if not is_ready(obj):
        pytest.skip("depends on test_example_reaches_ready[custom-capture-sizes]")
    assert obj["status"]["compileCache"]["claimName"] == claim
    selector = f"app.kubernetes.io/instance={name}"
    created = kubectl.json("pvc", "-n", NAMESPACE, "-l", selector)["items"]
    assert created == [], "the operator must not create a claim when existingClaim is set"
    (deployment,) = kubectl.json("deployments", "-n", NAMESPACE, "-l", selector)["items"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in deployment["spec"]["template"]["spec"].get("volumes", [])
        if "persistentVolumeClaim" in v
    ]
    assert claim in claims


def _snapshot(kubectl: Kubectl, name: str) -> dict[str, Any]:
    obj = kubectl.json("atomd", name, "-n", NAMESPACE)
    selector = f"app.kubernetes.io/instance={name}"
    replica_sets = kubectl.json("rs", "-n", NAMESPACE, "-l", selector)["items"]
    return {
        "generation": obj["metadata"]["generation"],
        "resourceVersion": obj["metadata"]["resourceVersion"],
        "revision": obj["status"].get("revision"),
        "replicaSets": sorted(rs["metadata"]["name"] for rs in replica_sets),
        "deploymentGenerations": sorted(
            (d["metadata"]["name"], d["metadata"]["generation"])
            for d in kubectl.json("deployments", "-n", NAMESPACE, "-l", selector)["items"]
        ),
    }


def _periodic_pass(operator: LocalOperator, kubectl: Kubectl) -> None:
    """Until the operator has reconciled as often as there are AtomDeployments here: with no
    change to react to, that is a periodic pass (every 2 s) over each of them."""
    start = operator.reconciles()
    count = len(kubectl.json("atomd", "-n", NAMESPACE)["items"])
    wait_for("a periodic reconcile pass", lambda: operator.reconciles() >= start + count,
             timeout=30)


def test_server_side_apply_twice_is_a_no_op(operator: LocalOperator, kubectl: Kubectl) -> None:
    example = ROOT / "examples" / "atomdeployment.yaml"
    (manifest,) = atomdeployments(example)
    name = manifest["metadata"]["name"]
    kubectl(*GITOPS_APPLY, "-f", str(example))
    wait_ready(kubectl, name, NAMESPACE, timeout=READY_TIMEOUT)
    _periodic_pass(operator, kubectl)  # it must not change anything either
    before = _snapshot(kubectl, name)
    out = kubectl(*GITOPS_APPLY, "-f", str(example), "-o", "yaml").stdout
    assert yaml.safe_load(out)["metadata"]["resourceVersion"] == before["resourceVersion"]
    _periodic_pass(operator, kubectl)
    after = _snapshot(kubectl, name)
    assert after == before


def test_graph_mode_change_in_git_rolls_a_new_revision(
    operator: LocalOperator, kubectl: Kubectl
) -> None:
    example = ROOT / "examples" / "atomdeployment.yaml"
    (manifest,) = atomdeployments(example)
    name = manifest["metadata"]["name"]
    kubectl(*GITOPS_APPLY, "-f", str(example))
    wait_ready(kubectl, name, NAMESPACE, timeout=READY_TIMEOUT)
    before = _snapshot(kubectl, name)
    changed = yaml.safe_load(example.read_text())
    changed["spec"]["compilation"]["cudagraphMode"] = "FULL_DECODE_ONLY"
    kubectl(*GITOPS_APPLY, "-f", "-", input=yaml.safe_dump(changed))
    obj = wait_ready(kubectl, name, NAMESPACE, timeout=READY_TIMEOUT)
    after = _snapshot(kubectl, name)
    assert after["generation"] == before["generation"] + 1
    assert after["revision"] != before["revision"]
    assert set(after["replicaSets"]) - set(before["replicaSets"]), "no new ReplicaSet rolled"
    selector = f"app.kubernetes.io/instance={name},atom.dev/revision={after['revision']}"
    pods = kubectl.json("pods", "-n", NAMESPACE, "-l", selector)["items"]
    assert pods and all(
        any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
        for p in pods
    )
    assert obj["status"]["observedGeneration"] == after["generation"]
    # Back to what Git says in examples/: the next test run starts from the example again.
    kubectl(*GITOPS_APPLY, "-f", str(example))
    wait_ready(kubectl, name, NAMESPACE, timeout=READY_TIMEOUT)


def expected_compilation(spec: dict[str, Any], role: str) -> dict[str, Any]:
    """The example's compilation for one role: shared fields, the role's overrides on top."""
    merged = dict(spec.get("compilation", {}))
    merged.update(spec.get("disaggregation", {}).get(role, {}).get("compilation", {}))
    if role == "decode":
        merged.setdefault("cudagraphMode", "FULL_DECODE_ONLY")  # the documented decode default
    return merged


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_example_settings_reach_the_runtime_command(
    operator: LocalOperator, kubectl: Kubectl, example: Path
) -> None:
    """What each example's comments promise is what its runtime pods are told to do."""
    from atom.cli.args import build_parser

    parser = build_parser()
    for manifest in atomdeployments(example):
        name = manifest["metadata"]["name"]
        obj = kubectl.json("atomd", name, "-n", NAMESPACE)
        if not is_ready(obj):
            pytest.skip(f"depends on test_example_reaches_ready[{example.stem}]")
        selector = f"app.kubernetes.io/instance={name}"
        for deployment in kubectl.json("deployments", "-n", NAMESPACE, "-l", selector)["items"]:
            role = deployment["metadata"]["labels"]["atom.dev/role"]
            if role == "router":
                continue
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            argv = container.get("command", []) + container.get("args", [])
            assert argv[:2] == ["atom-runtime", "serve"], argv
            args = parser.parse_args(argv[1:])  # the runtime's own parser accepts it
            want = expected_compilation(manifest["spec"], role)
            assert args.level == want.get("level", 3)
            if "cudagraphMode" in want:
                assert args.cudagraph_mode == want["cudagraphMode"], (role, argv)
            if "cudagraphCaptureSizes" in want:
                assert args.cudagraph_capture_sizes == want["cudagraphCaptureSizes"], (role, argv)
            engine = manifest["spec"].get("engine", {})
            if "maxNumSeqs" in engine:
                assert args.max_num_seqs == engine["maxNumSeqs"]
            assert args.model == manifest["spec"]["model"]["name"]
            assert args.load_format == manifest["spec"]["model"]["loadFormat"]
            assert args.role == role
