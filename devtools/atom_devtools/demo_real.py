"""The demo on a real node (hack/demo's default): every pod in it really runs.

Images are built from the Dockerfile with buildah (reused while their inputs are unchanged) and
imported into the node's containerd; the chart installs the operator as a real pod; the CPU
example's runtime pod starts with SmolLM2-135M-Instruct from the model image (an image
volume), its startup probe keeps it un-Ready through load and compile, the AtomDeployment turns
Ready when the pod does, and a chat completion goes through the Service's ClusterIP
(kube-proxy's rules serve the host too) to that pod, with the official openai client.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

import yaml

from atom_devtools.kubectl import ROOT, Kubectl, describe, is_ready
from atom_devtools.printer import Printer, relative

CPU_EXAMPLE = ROOT / "examples" / "atomdeployment-cpu.yaml"
CHART = ROOT / "charts" / "atom-operator"
OPERATOR_NAMESPACE = "atom-system"
RELEASE = "atom-operator"
QUESTION = "What is the capital of France?"


def real_node_values(images: dict[str, Any]) -> list[str]:
    """helm --set flags: the locally built images, the operator pod on the tainted real node."""
    op_repo, op_tag = images["operator"].ref.rsplit(":", 1)
    rt_repo, rt_tag = images["runtime"].ref.rsplit(":", 1)
    return [
        "--set", f"operator.image.repository={op_repo}", "--set", f"operator.image.tag={op_tag}",
        "--set", f"runtime.image.repository={rt_repo}", "--set", f"runtime.image.tag={rt_tag}",
        "--set", "operator.reconcileInterval=5",
        "--set", "operator.nodeSelector.type=real",
        "--set", "operator.tolerations[0].key=atom.dev/real-node",
        "--set", "operator.tolerations[0].operator=Exists",
        "--set", "operator.tolerations[0].effect=NoSchedule",
    ]  # fmt: skip


def helm_install(kubectl: Kubectl, images: dict[str, Any], timeout: float = 300) -> str:
    result = kubectl.run(
        "helm", "install", RELEASE, str(CHART), "-n", OPERATOR_NAMESPACE, "--create-namespace",
        "--wait", f"--timeout={int(timeout)}s", *real_node_values(images), timeout=timeout + 30,
    )  # fmt: skip
    return result.stdout


def pod_line(kubectl: Kubectl, namespace: str, selector: str) -> str:
    """`name phase ready=… restarts=…` of the selected pods (what the demo narrates)."""
    pods = kubectl.json("pods", "-n", namespace, "-l", selector)["items"]
    parts = []
    for pod in pods:
        statuses = pod.get("status", {}).get("containerStatuses") or [{}]
        ready = all(s.get("ready") for s in statuses)
        restarts = sum(s.get("restartCount", 0) for s in statuses)
        parts.append(
            f"pod {pod['metadata']['name']}: {pod['status'].get('phase')} "
            f"ready={str(ready).lower()} restarts={restarts}"
        )
    return "; ".join(parts) or "no pod yet"


def wait_ready_with_pods(
    kubectl: Kubectl, name: str, namespace: str, timeout: float, printer: Printer
) -> tuple[dict[str, Any], float]:
    """Poll the AtomDeployment and its pods until Ready; narrate each change; the seconds the
    pod spent Running but not Ready (the startup probe holding it through compile)."""
    deadline = time.monotonic() + timeout
    last, running_since, gated = "", None, 0.0
    selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/component=runtime"
    while True:
        obj = kubectl.json("atomd", name, "-n", namespace)
        pods = pod_line(kubectl, namespace, selector)
        line = f"{pods} | atomd {describe(obj)}"
        if line != last:
            printer.detail(line)
            last = line
        if "Running ready=false" in pods and running_since is None:
            running_since = time.monotonic()
        if is_ready(obj):
            if running_since is not None:
                gated = time.monotonic() - running_since
            return obj, gated
        if time.monotonic() > deadline:
            raise TimeoutError(f"atomd/{name} not Ready after {timeout}s: {line}")
        time.sleep(1)


def run_real(args: argparse.Namespace, printer: Printer, pids: list[int]) -> None:
    from openai import OpenAI

    from atom_devtools import images as image_builds
    from atom_devtools.devcluster import LocalCluster

    example = Path(args.example or CPU_EXAMPLE).resolve()
    manifest = yaml.safe_load(example.read_text())
    name, namespace = manifest["metadata"]["name"], args.namespace

    printer.step("Building the operator, CPU runtime and model images with buildah (reused "
                 "while their inputs are unchanged)")  # fmt: skip
    start = time.monotonic()
    images = image_builds.build()
    for target, image in images.items():
        printer.detail(f"{target}: {image.ref}")
    printer.detail(f"ready in {time.monotonic() - start:.0f}s")

    with contextlib.ExitStack() as stack:
        printer.step("Starting a local cluster: control plane, kwok GPU nodes and one real node "
                     "(containerd, kubelet, CNI bridge, kube-proxy, CoreDNS)")  # fmt: skip
        cluster = stack.enter_context(LocalCluster(real_node=True, log=printer.detail))
        stack.callback(printer.detail, "cluster stopped")
        pids += [p.popen.pid for p in cluster.procs if p.popen is not None]
        kubectl = Kubectl(cluster.env())
        printer.detail(kubectl("get", "nodes").stdout)
        start = time.monotonic()
        for image in images.values():
            cluster.node.import_image(image.layout, image.ref)
        printer.detail(f"images in the node's containerd ({time.monotonic() - start:.0f}s)")

        printer.step(f"Installing the operator with Helm ({relative(CHART)}): a real pod on the "
                     "real node, with the chart's RBAC")  # fmt: skip
        start = time.monotonic()
        helm_install(kubectl, images, timeout=args.timeout)
        printer.detail(f"helm install --wait: {time.monotonic() - start:.0f}s")
        printer.detail(kubectl("get", "pods", "-n", OPERATOR_NAMESPACE, "-o", "wide").stdout)

        printer.step(f"Applying {relative(example)}")
        kubectl("create", "namespace", namespace, check=False)
        printer.detail(kubectl("apply", "-n", namespace, "-f", str(example)).stdout)

        printer.step(f"Waiting for atomd/{name}: its pod runs, and stays un-Ready until compile "
                     "is done (startup probe on /health)")  # fmt: skip
        _, gated = wait_ready_with_pods(kubectl, name, namespace, args.timeout, printer)
        printer.detail(f"the startup probe held the pod un-Ready for {gated:.0f}s")
        printer.detail("$ kubectl get atomd")
        printer.detail(kubectl("get", "atomd", "-n", namespace).stdout)

        service = kubectl.json("service", name, "-n", namespace)
        url = f"http://{service['spec']['clusterIP']}:{service['spec']['ports'][0]['port']}"
        printer.step(f"A chat completion through the Service (ClusterIP {url}) with the openai "
                     "client")  # fmt: skip
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        printer.detail(f"models: {model}")
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=32,
            temperature=0.0,
        )
        choice = chat.choices[0]
        printer.detail(f"question: {QUESTION}")
        printer.detail(f"answer:   {choice.message.content}")
        usage = chat.usage
        if usage:
            printer.detail(
                f"finish:   {choice.finish_reason}, {usage.prompt_tokens} prompt + "
                f"{usage.completion_tokens} completion tokens"
            )
        pod = kubectl.json("pods", "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
        printer.detail(f"served by pod {pod['items'][0]['metadata']['name']} "
                       f"({pod['items'][0]['status'].get('podIP')}) on node "
                       f"{pod['items'][0]['spec'].get('nodeName')}")  # fmt: skip

        printer.step("Tearing down (the same happens on Ctrl-C)")
