"""What the lint tests check: every child the operator renders for the golden specs and the
examples, and the chart, written as YAML files into a folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests" / "operator"), str(ROOT / "tests" / "chart")]


def tool(name: str) -> str:
    """The pinned linter where `hack/controlplane install` put it ($ATOM_CACHE_DIR); the test
    skips only when it is not installed there."""
    from atom_devtools.devcluster.cache import LINT_COMPONENTS

    comp = LINT_COMPONENTS[name]
    if not comp.is_installed():
        pytest.skip(
            f"{name} {comp.version} is not installed in {comp.bin_dir} "
            f"(run hack/controlplane install {name})"
        )
    return str(comp.path())


def write_children(out: Path) -> None:
    from atomd_helpers import IMAGE, OWNER, SPECS, spec

    from atom_operator import builders
    from atom_operator.builders import Owner
    from atom_operator.models import AtomDeploymentSpec
    from atom_operator.snapshot import Snapshot

    for name in SPECS:
        objs = builders.plan(OWNER, spec(name), IMAGE, Snapshot()).apply
        (out / f"golden-{name}.yaml").write_text(yaml.safe_dump_all(objs))
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "AtomDeployment":
                owner = Owner(doc["metadata"]["name"], "serving", "u")
                parsed = AtomDeploymentSpec.model_validate(doc["spec"])
                objs = builders.plan(owner, parsed, IMAGE, Snapshot()).apply
                (out / f"example-{owner.name}.yaml").write_text(yaml.safe_dump_all(objs))


def write_chart(out: Path, variants: dict[str, list[str]]) -> None:
    """`helm template` of the chart once per named list of extra arguments."""
    from chartutil import CHART, find_helm, kube_version

    helm = find_helm()
    if helm is None:
        pytest.skip("helm is not installed (run hack/controlplane install)")
    for name, values in variants.items():
        text = subprocess.run(
            [helm, "template", "atom", str(CHART), "-n", "atom-system",
             "--kube-version", kube_version(), *values],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (out / f"chart-{name}.yaml").write_text(text)
