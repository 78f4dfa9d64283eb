"""The GitOps demo (`hack/demo --gitops`): Flux rolls a graph-mode change out of Git, then a
`git revert` rolls it back.

A local control plane with kwok GPU nodes and Flux's source-controller and kustomize-controller
(the flux addon, built on first use), the operator as a local process, and a Git server on
127.0.0.1. The example AtomDeployment goes into a repository that a Flux Kustomization follows;
the demo pushes a commit changing its graph mode, watches `kubectl get atomd` and the
Kustomization roll it out, reverts the commit, watches the rollback, and stops everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from atom_devtools.devcluster import addons
from atom_devtools.devcluster.fluxrepo import FluxRepo, condition
from atom_devtools.devcluster.gitserver import Checkout, GitServer
from atom_devtools.kubectl import ROOT, Kubectl, install_crd
from atom_devtools.localprocs import LocalOperator
from atom_devtools.printer import Printer, relative

EXAMPLE = ROOT / "examples" / "atomdeployment.yaml"
FILE = "models/atomdeployment.yaml"
DOC = ROOT / "docs" / "gitops.md"


def doc_flux_manifests() -> tuple[dict[str, Any], dict[str, Any]]:
    """The GitRepository and the Kustomization docs/gitops.md shows (fresh copies): what the
    demo and tests/e2e/test_gitops_flux.py apply."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)
    docs = {doc.get("kind"): doc for block in blocks for doc in yaml.safe_load_all(block)
            if doc and str(doc.get("apiVersion", "")).endswith("toolkit.fluxcd.io/v1")}
    missing = {"GitRepository", "Kustomization"} - set(docs)
    if missing:
        raise ValueError(f"{DOC} shows no Flux {sorted(missing)}")
    return docs["GitRepository"], docs["Kustomization"]


def _manifest(example: dict[str, Any], namespace: str, mode: str) -> str:
    doc = dict(example, metadata={**example["metadata"], "namespace": namespace})
    doc["spec"] = {**example["spec"],
                   "compilation": {**example["spec"].get("compilation", {}), "cudagraphMode": mode}}
    return yaml.safe_dump(doc, sort_keys=False)


def _watch(repo: FluxRepo, kubectl: Kubectl, sha: str, name: str, namespace: str,
           printer: Printer, timeout: float) -> float:
    """Print each change of the Kustomization's and the AtomDeployment's state until the
    Kustomization is Ready at `sha`; returns the seconds it took."""
    start, last = time.monotonic(), ""
    while True:
        ks = repo.get("kustomization", "models")
        ready = condition(ks, "Ready")
        got = kubectl("get", "atomd", name, "-n", namespace, "-o", "json", check=False)
        obj = json.loads(got.stdout) if got.returncode == 0 else None  # not applied yet
        status = (obj or {}).get("status", {})
        atomd = (f"{status.get('phase', '-')} {status.get('ready', '-')} "
                 f"revision {status.get('revision', '-')}" if obj else "not applied yet")
        line = (f"kustomization models: {ready.get('reason') or '-':<23} "
                f"atomd/{name}: {atomd}")
        if line != last:
            printer.detail(f"{time.monotonic() - start:5.1f}s  {line}")
            last = line
        applied = (ks.get("status") or {}).get("lastAppliedRevision", "")
        if ready.get("status") == "True" and applied.endswith(sha):
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"Kustomization models not Ready at {sha[:7]} after {timeout}s")
        time.sleep(0.5)


def run(args: argparse.Namespace, printer: Printer, pids: list[int]) -> None:
    from atom_devtools.devcluster import LocalCluster

    example_path = Path(args.example or EXAMPLE).resolve()
    example = yaml.safe_load(example_path.read_text())
    name, namespace = example["metadata"]["name"], args.namespace
    first_mode = example["spec"].get("compilation", {}).get("cudagraphMode", "TR_HYBRID")
    new_mode = "FULL_DECODE_ONLY" if first_mode != "FULL_DECODE_ONLY" else "TR_HYBRID"
    workdir = Path(tempfile.mkdtemp(prefix="atom-demo-gitops-"))

    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, True)
        printer.step("Flux's controllers (source-controller, kustomize-controller: the flux "
                     "addon, built once into the cache)")
        flux = addons.wait_installed("flux")
        printer.detail(f"{flux.bin_dir}")

        printer.step("Starting a local Kubernetes control plane with kwok GPU nodes and Flux")
        cluster = stack.enter_context(LocalCluster(log=printer.detail, flux=True))
        stack.callback(printer.detail, "control plane and Flux stopped")
        pids += [p.popen.pid for p in cluster.procs if p.popen is not None]
        kubectl = Kubectl(cluster.env())
        printer.detail(kubectl("get", "pods,deployments", "-n", "flux-system").stdout
                       or "(Flux runs as host processes: no pods)")

        printer.step("The AtomDeployment CRD and the operator (a local process)")
        install_crd(kubectl)
        kubectl("create", "namespace", namespace, check=False)
        operator = stack.enter_context(
            LocalOperator(cluster.env(), workdir / "operator.log", namespaces=[namespace]))
        pids.append(operator.pid)

        printer.step(f"A Git repository on 127.0.0.1 with {relative(example_path)} "
                     f"(cudagraphMode {first_mode})")
        server = stack.enter_context(GitServer())
        url = server.create("platform")
        repo = FluxRepo(kubectl, Checkout(url, workdir / "platform"), "platform")
        sha = repo.checkout.commit({FILE: _manifest(example, namespace, first_mode)},
                                   f"{name}: {first_mode}")
        printer.detail(f"{url}  commit {sha[:7]}")
        source, models = doc_flux_manifests()
        source["spec"]["url"] = url
        kubectl("apply", "-f", "-", input=yaml.safe_dump_all([source, models]))
        printer.detail(f"GitRepository platform and Kustomization models from {relative(DOC)} "
                       "(wait: true with its healthCheckExprs) applied")
        took = _watch(repo, kubectl, sha, name, namespace, printer, args.timeout)
        printer.detail(f"Ready {took:.1f}s after Flux was pointed at the repository")
        printer.detail(kubectl("get", "atomd", "-n", namespace).stdout)
        first_revision = kubectl.json("atomd", name, "-n", namespace)["status"]["revision"]

        printer.step(f"git push: cudagraphMode {first_mode} -> {new_mode}")
        change = repo.push({FILE: _manifest(example, namespace, new_mode)},
                           f"{name}: {new_mode}")
        took = _watch(repo, kubectl, change, name, namespace, printer, args.timeout)
        printer.detail(f"push -> Kustomization Ready: {took:.1f}s")
        printer.detail(kubectl("get", "atomd", "-n", namespace).stdout)

        printer.step(f"git revert {change[:7]}")
        revert = repo.revert(change)
        took = _watch(repo, kubectl, revert, name, namespace, printer, args.timeout)
        revision = kubectl.json("atomd", name, "-n", namespace)["status"]["revision"]
        printer.detail(f"revert -> Kustomization Ready: {took:.1f}s; revision {revision} "
                       f"{'is' if revision == first_revision else 'is NOT'} the first one")
        printer.detail(kubectl("get", "kustomization", "-n", "flux-system").stdout)

        printer.step("Tearing down (the same happens on Ctrl-C)")
