"""The demo on kwok nodes only (`hack/demo --kwok`): no images, no root.

A local control plane starts (etcd, kube-apiserver, controller-manager, scheduler, kwok fake
nodes), the CRD is installed, the operator runs as a local process (container images cannot
run here: kwok only pretends to run pods), examples/atomdeployment.yaml is applied and waited
for, and then one real runtime process serves a tiny dummy model on the CPU and answers a
completion through the official openai client.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from pathlib import Path

import yaml

from atom_devtools.kubectl import CRD_FILE, CRD_NAME, ROOT, Kubectl, install_crd, wait_ready
from atom_devtools.localprocs import LocalOperator, RuntimeProcess, free_port
from atom_devtools.printer import Printer, relative

EXAMPLE = ROOT / "examples" / "atomdeployment.yaml"


def run(args: argparse.Namespace, printer: Printer, pids: list[int]) -> None:
    """The demo's steps; `pids` collects every process group started, for the final check."""
    from openai import OpenAI

    from atom_devtools.devcluster import LocalCluster

    example = Path(args.example or EXAMPLE).resolve()
    manifest = yaml.safe_load(example.read_text())
    name = manifest["metadata"]["name"]
    namespace = args.namespace
    workdir = Path(tempfile.mkdtemp(prefix="atom-demo-"))

    with contextlib.ExitStack() as stack:
        printer.step("Starting a local Kubernetes control plane (etcd, kube-apiserver, "
                     "controller-manager, scheduler, kwok fake nodes)")  # fmt: skip
        cluster = stack.enter_context(LocalCluster(log=printer.detail))
        stack.callback(printer.detail, "control plane stopped")
        pids += [p.popen.pid for p in cluster.procs if p.popen is not None]
        kubectl = Kubectl(cluster.env())
        printer.detail(kubectl("get", "nodes").stdout)

        printer.step(f"Installing the AtomDeployment CRD ({relative(CRD_FILE)})")
        install_crd(kubectl)
        printer.detail(kubectl("get", "crd", CRD_NAME).stdout)

        printer.step("Starting the operator as a local process (images cannot run here: kwok "
                     "nodes run no containers, so the chart's operator pod would be a pretend one)")  # fmt: skip
        operator = stack.enter_context(
            LocalOperator(cluster.env(), workdir / "operator.log", namespaces=[namespace])
        )
        stack.callback(printer.detail, "operator stopped")
        pids.append(operator.pid)
        printer.detail(f"pid {operator.pid}, /healthz on :{operator.health_port}, "
                       f"log {operator.log_path}")  # fmt: skip

        printer.step(f"Applying {relative(example)}")
        kubectl("create", "namespace", namespace, check=False)
        printer.detail(kubectl("apply", "-n", namespace, "-f", str(example)).stdout)

        printer.step(f"Waiting for atomd/{name} to be Ready (kwok marks its pods Ready)")
        try:
            wait_ready(kubectl, name, namespace, timeout=args.timeout, progress=printer.detail)
        except TimeoutError:
            printer.detail("operator log (last lines):\n" + operator.log_tail())
            raise
        printer.detail("$ kubectl get atomd")
        printer.detail(kubectl("get", "atomd", "-n", namespace).stdout)

        printer.step("The children the operator made")
        selector = f"app.kubernetes.io/instance={name}"
        kinds = "configmaps,services,deployments,pvc,pods"
        printer.detail(f"$ kubectl get {kinds} -l {selector}")
        printer.detail(kubectl("get", kinds, "-n", namespace, "-l", selector).stdout)
        for deployment in kubectl.json("deployments", "-n", namespace, "-l", selector)["items"]:
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            argv = container.get("command", []) + container.get("args", [])
            printer.detail(f"{deployment['metadata']['name']} runs: {' '.join(argv)}")

        printer.step("Starting one real runtime process on the CPU: atom-runtime serve "
                     f"--model {args.model} --load-format dummy --level 0")  # fmt: skip
        server = stack.enter_context(
            RuntimeProcess(args.model, free_port(), workdir / "runtime.log")
        )
        stack.callback(printer.detail, "runtime stopped")
        pids.append(server.pid)
        server.wait_healthy(timeout=args.timeout, progress=printer.detail)
        printer.detail(f"{server.url}/health -> 200")

        printer.step("A completion through the official openai client")
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        printer.detail("models: " + ", ".join(m.id for m in client.models.list().data))
        completion = client.completions.create(
            model=args.model, prompt=args.prompt, max_tokens=16, temperature=0.0
        )
        choice = completion.choices[0]
        printer.detail(f"prompt:  {args.prompt!r}")
        printer.detail(f"text:    {choice.text!r}  (random weights: the tokens are noise)")
        usage = completion.usage
        tokens = (
            f"{usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens"
            if usage
            else ""
        )
        printer.detail(f"finish:  {choice.finish_reason}, {tokens}")

        printer.step("Tearing down (the same happens on Ctrl-C)")
        stack.callback(shutil.rmtree, workdir, True)
