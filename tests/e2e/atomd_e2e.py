"""Helpers for the operator e2e tests: the operator as a real subprocess, kubectl, polling."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml

from atom_devtools.kubectl import Kubectl as DemoKubectl
from atom_devtools.kubectl import install_crd
from atom_devtools.localprocs import free_port
from atom_operator.kube import Kube
from testutil import wait_for

T = TypeVar("T")


class Kubectl(DemoKubectl):
    """The demo's kubectl (one cluster's environment), plus server-side applies of manifests
    as the e2e user."""

    def apply(
        self, manifest: dict[str, Any] | list[dict[str, Any]], *extra: str, check: bool = True
    ) -> subprocess.CompletedProcess:
        docs = manifest if isinstance(manifest, list) else [manifest]
        return self(
            "apply",
            "--server-side",
            "--field-manager=e2e-user",
            *extra,
            "-f",
            "-",
            input=yaml.safe_dump_all(docs),
            check=check,
        )


class OperatorProcess:
    """`python -m atom_operator.main` with the cluster's kubeconfig; killable and restartable."""

    def __init__(self, env: dict[str, str], log_dir: Path, namespace: str) -> None:
        self.port = free_port()
        self.env = {
            **env,
            "ATOM_OPERATOR_NAMESPACES": namespace,
            "ATOM_OPERATOR_RECONCILE_INTERVAL": "2",
            "ATOM_OPERATOR_HEALTH_PORT": str(self.port),
            "ATOM_OPERATOR_METRICS_PORT": str(free_port()),
            "ATOM_OPERATOR_DEFAULT_IMAGE": "atom-runtime:e2e",
            "ATOM_OPERATOR_LOG_LEVEL": "INFO",
        }
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.argv = [sys.executable, "-m", "atom_operator.main"]  # the fault harness wraps it

    def start(self) -> None:
        self.starts += 1
        log = open(self.log_dir / f"operator-{self.starts}.log", "w")  # noqa: SIM115 (closed with the process)
        self.proc = subprocess.Popen(
            self.argv,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_for(f"operator /healthz on :{self.port}\n{self.log_tail()}", self.healthy, timeout=60)

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"operator exited {self.proc.returncode}:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL: no cleanup, as if the node died mid-reconcile."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        path = self.log_dir / f"operator-{self.starts}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""


@contextlib.contextmanager
def running_operator(
    kubectl: Kubectl, env: dict[str, str], log_dir: Path, namespace: str, **env_overrides: str
) -> Iterator[OperatorProcess]:
    """The CRD installed, the namespace there, one operator watching it (env overrides on
    top of OperatorProcess's); its AtomDeployments deleted when done."""
    install_crd(kubectl)
    kubectl("create", "namespace", namespace, check=False)
    op = OperatorProcess(env, log_dir, namespace)
    op.env.update(env_overrides)
    op.start()
    try:
        yield op
    finally:
        op.stop()
        kubectl("delete", "atomd", "--all", "-n", namespace, "--wait=false", check=False)


def atomd(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "atom.dev/v1alpha1",
        "kind": "AtomDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def pre_bound_pv(
    name: str, namespace: str, claim: str, storage_class: str, base: Path
) -> dict[str, Any]:
    """A PV reserved for one claim (the local cluster has no provisioner)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteMany"],
            "storageClassName": storage_class,
            "persistentVolumeReclaimPolicy": "Retain",
            "hostPath": {"path": str(base / name)},
            "claimRef": {"namespace": namespace, "name": claim},
        },
    }


def get(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    obj = kube.get("AtomDeployment", namespace, name)
    assert obj is not None, f"AtomDeployment {name} missing"
    return obj


def condition(obj: dict[str, Any], ctype: str) -> dict[str, Any]:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c["type"] == ctype:
            return c
    return {}


def is_ready(obj: dict[str, Any]) -> bool:
    st = obj.get("status") or {}
    return (
        st.get("observedGeneration") == obj["metadata"]["generation"]
        and st.get("phase") == "Ready"
        and condition(obj, "Ready").get("status") == "True"
    )


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1)[:3000]


def env_with_path(cluster_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **cluster_env}


