"""The newcomer demo (`hack/demo`): the whole loop on one machine, from nothing.

By default every pod really runs on a real node (demo_real.py). With --kwok, the older loop:
a local control plane starts (etcd, kube-apiserver, controller-manager, scheduler, kwok fake
nodes), the CRD is installed, the operator runs as a local process (container images cannot
run here: kwok only pretends to run pods), examples/atomdeployment.yaml is applied and waited
for, and then one real runtime process serves a tiny dummy model on the CPU and answers a
completion through the official openai client. Ctrl-C or the end tears everything down.

The helpers here (Kubectl, install_crd, LocalOperator, wait_ready) are also what the e2e tests
use, so the demo and the tests exercise the same path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import yaml

from atom_devtools.devcluster.crds import wait_crd_established

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "atomdeployment.yaml"
CRD_NAME = "atomdeployments.atom.dev"
EXAMPLE = ROOT / "examples" / "atomdeployment.yaml"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Kubectl:
    """kubectl bound to one cluster's environment (KUBECONFIG, PATH with the cached binaries)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(os.environ, **env)

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            ["kubectl", *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed:\n{result.stderr.strip()}")
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self("get", *args, "-o", "json").stdout)

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """Another tool (helm) in the same environment; raises with its stderr on failure."""
        result = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} failed:\n{result.stderr.strip()}")
        return result


def install_crd(kubectl: Kubectl) -> None:
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    wait_crd_established(kubectl, CRD_NAME)


def _get(url: str, timeout: float = 2) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except OSError as error:
        return 0, str(error)


class _Child:
    """A child process in its own session that dies with the demo (devcluster's Process)."""

    name = "child"

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        from atom_devtools.devcluster.procs import Process

        self.log_path = log_path
        self.proc = Process(self.name, argv, log_path, env=env)

    @property
    def pid(self) -> int:
        assert self.proc.popen is not None, "not started"
        return self.proc.popen.pid

    def _check_alive(self) -> None:
        if not self.proc.alive:
            code = self.proc.popen.returncode if self.proc.popen else None
            raise RuntimeError(f"{self.name} exited with {code}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        self.proc.start()

    def stop(self, grace: float = 20) -> None:
        from atom_devtools.devcluster.procs import stop_all

        stop_all([self.proc], grace=grace)  # SIGTERM (both shut down in order), then SIGKILL


class LocalOperator(_Child):
    """`python -m atom_operator.main` as a child process, with its log in a file."""

    name = "atom-operator"

    def __init__(
        self,
        env: dict[str, str],
        log_path: Path,
        namespaces: Sequence[str] = (),
        reconcile_interval: float = 2.0,
    ) -> None:
        self.health_port = free_port()
        full_env = dict(os.environ, **env)
        full_env.update(
            ATOM_OPERATOR_NAMESPACES=",".join(namespaces),
            ATOM_OPERATOR_RECONCILE_INTERVAL=str(reconcile_interval),
            ATOM_OPERATOR_HEALTH_PORT=str(self.health_port),
            PYTHONUNBUFFERED="1",
        )
        super().__init__([sys.executable, "-m", "atom_operator.main"], log_path, full_env)

    def __enter__(self) -> LocalOperator:
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout: float = 60) -> None:
        url = f"http://127.0.0.1:{self.health_port}/healthz"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            if _get(url)[0] == 200:
                return
            time.sleep(0.5)
        raise RuntimeError(f"operator not healthy on {url} after {timeout}s:\n{self.log_tail()}")


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in obj.get("status", {}).get("conditions") or []}


def is_ready(obj: dict[str, Any]) -> bool:
    """Ready=True for the current generation (what `kubectl wait --for=condition=Ready` means)."""
    status = obj.get("status", {})
    ready = _conditions(obj).get("Ready", {})
    return (
        status.get("observedGeneration") == obj["metadata"].get("generation")
        and ready.get("status") == "True"
    )


def describe(obj: dict[str, Any]) -> str:
    status = obj.get("status", {})
    conditions = _conditions(obj)
    parts = [f"phase={status.get('phase', '-')}", f"ready={status.get('ready', '-')}"]
    for kind in ("Ready", "Progressing", "Degraded", "CompileCacheReady"):
        if kind in conditions:
            c = conditions[kind]
            parts.append(f"{kind}={c['status']}({c.get('reason', '')})")
    return " ".join(parts)


def wait_ready(
    kubectl: Kubectl,
    name: str,
    namespace: str,
    timeout: float = 180,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Poll the AtomDeployment until Ready; report each change of its status line."""
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        obj = kubectl.json("atomd", name, "-n", namespace)
        line = describe(obj)
        if progress and line != last:
            progress(line)
            last = line
        if is_ready(obj):
            return obj
        if time.monotonic() > deadline:
            degraded = [c for c in obj.get("status", {}).get("conditions", [])
                        if c.get("type") == "Degraded" and c.get("status") == "True"]
            why = f" ({degraded[0].get('message', '')})" if degraded else ""
            raise TimeoutError(f"atomd/{name} not Ready after {timeout}s: {line}{why}")
        time.sleep(1)


class RuntimeProcess(_Child):
    """One real `atom-runtime serve` on the CPU, stopped on exit."""

    name = "atom-runtime"

    def __init__(self, model: str, port: int, log_path: Path) -> None:
        script = Path(sys.executable).with_name("atom-runtime")  # the console script, as documented
        launcher = [str(script)] if script.exists() else [sys.executable, "-m", "atom.cli.main"]
        self.port = port
        self.argv = [
            *launcher, "serve",
            "--model", model, "--load-format", "dummy", "--level", "0",
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
        super().__init__(self.argv, log_path, dict(os.environ, PYTHONUNBUFFERED="1"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RuntimeProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(grace=15)

    def wait_healthy(
        self, timeout: float = 300, progress: Callable[[str], None] | None = None
    ) -> None:
        """Poll /health (503 with a reason until compile and capture are done)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            self._check_alive()
            code, body = _get(self.url + "/health")
            if code == 200:
                return
            line = f"/health -> {code} {body.strip()[:100]}" if code else "/health -> no answer yet"
            if progress and line != last:
                progress(line)
                last = line
            time.sleep(0.5)
        raise TimeoutError(f"atom-runtime not healthy after {timeout}s:\n{self.log_tail()}")


def leftovers(pids: Sequence[int]) -> list[int]:
    """Process groups (one per child, each led by its pid) that still have a live member."""
    alive = []
    for pid in pids:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        alive.append(pid)
    return alive


class Printer:
    """Numbered steps and indented detail lines, flushed at once (the README shows them)."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.step_no = 0
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        self.step_no += 1
        elapsed = time.monotonic() - self.started
        print(f"\n[{self.step_no}] {text}  (t={elapsed:.0f}s)", file=self.out, flush=True)

    def detail(self, text: str) -> None:
        for line in text.rstrip().splitlines():
            print(f"    {line}", file=self.out, flush=True)


def _raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


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

        printer.step(f"Installing the AtomDeployment CRD ({_relative(CRD_FILE)})")
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

        printer.step(f"Applying {_relative(example)}")
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/demo", description=__doc__.splitlines()[0])
    parser.add_argument("--example", default=None, help="AtomDeployment manifest to apply "
                        "(default: examples/atomdeployment-cpu.yaml, with --kwok "
                        "examples/atomdeployment.yaml)")
    parser.add_argument("--kwok", action="store_true", help="kwok nodes only: the operator as a "
                        "local process and the runtime as a local process (no images, no root)")
    parser.add_argument("--namespace", default="atom-demo")
    parser.add_argument(
        "--model", default="tiny-llama", help="built-in shape the CPU runtime serves"
    )
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per wait")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # `kill` tears down like Ctrl-C
    # Python leaves SIGINT ignored when it starts with it ignored (a job put in the background
    # by a non-interactive shell, some CI runners): Ctrl-C must tear down all the same.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    printer = Printer()
    pids: list[int] = []
    try:
        if args.kwok:
            run(args, printer, pids)
        else:
            from atom_devtools.demo_real import run_real

            run_real(args, printer, pids)
        status, outcome = 0, ""
    except KeyboardInterrupt:
        status, outcome = 130, "interrupted"
    except Exception as error:  # a newcomer needs the reason, not a traceback
        status, outcome = 1, f"demo failed: {error}"
    if outcome:
        print(f"\n{outcome}", file=sys.stderr, flush=True)
    alive = leftovers(pids)
    if alive:
        printer.detail(f"still running after teardown: process groups {alive}")
        return status or 1
    printer.detail(f"nothing left running ({len(pids)} processes started, all stopped)")
    return status


if __name__ == "__main__":
    sys.exit(main())
