"""Helpers shared by the chart tests: paths, the helm binary, command runners."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "atom-operator"


def find_helm() -> str | None:
    """The provisioned helm (hack/controlplane install), else one on PATH."""
    try:
        from atom_devtools.devcluster.cache import HELM

        if HELM.is_installed():
            return str(HELM.path())
    except ImportError:
        pass
    return shutil.which("helm")


def kube_version() -> str:
    """The Kubernetes version the local cluster runs; helm template/lint check kubeVersion."""
    try:
        from atom_devtools.devcluster.versions import KUBERNETES

        return KUBERNETES
    except ImportError:
        return "v1.36.0"


Runner = Callable[..., subprocess.CompletedProcess[str]]


def make_runner(env: dict[str, str] | None) -> Runner:
    def run(
        args: Sequence[str], *, check: bool = True, input: str | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            list(args),
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
            env=env,
            cwd=ROOT,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
            )
        return result

    return run
