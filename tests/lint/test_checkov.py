"""checkov's Kubernetes checks over every child the operator renders (golden specs and
examples) and over the chart, with the documented skip list (checkov_skips.yaml).

checkov is not a project dependency (its own pins would move the shared environment): set
ATOM_CHECKOV to its binary or put it on PATH (`python -m venv v && v/bin/pip install checkov`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
SKIPS = yaml.safe_load((Path(__file__).parent / "checkov_skips.yaml").read_text())


def _checkov() -> str:
    found = os.environ.get("ATOM_CHECKOV") or shutil.which("checkov")
    if not found:
        pytest.skip("checkov is not installed (set ATOM_CHECKOV)")
    return found


def _skips(where: str) -> str:
    return ",".join(s["id"] for s in SKIPS if where in s["where"])


def _run(checkov: str, target: Path, where: str) -> None:
    proc = subprocess.run(
        [checkov, "-d", str(target), "--framework", "kubernetes", "--compact", "--quiet",
         "--skip-check", _skips(where), "--skip-download"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    failed = [line for line in proc.stdout.splitlines() if "FAILED" in line or "Check:" in line]
    assert proc.returncode == 0, "\n".join(failed) or proc.stdout[-3000:] + proc.stderr[-2000:]


def test_skip_list_explains_every_exclusion() -> None:
    for skip in SKIPS:
        assert skip["id"].startswith("CKV") and skip["where"] and len(skip["why"]) > 40, skip


def test_rendered_children_pass(tmp_path: Path) -> None:
    checkov = _checkov()
    sys.path.insert(0, str(ROOT / "tests" / "operator"))
    from atomd_helpers import IMAGE, OWNER, SPECS, spec

    from atom_operator import builders
    from atom_operator.builders import Owner
    from atom_operator.models import AtomDeploymentSpec
    from atom_operator.snapshot import Snapshot

    for name in SPECS:
        objs = builders.plan(OWNER, spec(name), IMAGE, Snapshot()).apply
        (tmp_path / f"golden-{name}.yaml").write_text(yaml.safe_dump_all(objs))
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "AtomDeployment":
                owner = Owner(doc["metadata"]["name"], "serving", "u")
                parsed = AtomDeploymentSpec.model_validate(doc["spec"])
                objs = builders.plan(owner, parsed, IMAGE, Snapshot()).apply
                (tmp_path / f"example-{owner.name}.yaml").write_text(yaml.safe_dump_all(objs))
    _run(checkov, tmp_path, "children")


def test_chart_passes(tmp_path: Path) -> None:
    checkov = _checkov()
    sys.path.insert(0, str(ROOT / "tests" / "chart"))
    from chartutil import CHART, find_helm, kube_version

    helm = find_helm()
    if helm is None:
        pytest.skip("helm is not installed (run hack/controlplane install)")
    out = subprocess.run(
        [helm, "template", "atom", str(CHART), "-n", "atom-system", "--kube-version",
         kube_version(), "--set", "monitoring.grafanaDashboard.enabled=true"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    (tmp_path / "chart.yaml").write_text(out)
    _run(checkov, tmp_path, "chart")
