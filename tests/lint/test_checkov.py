"""checkov's Kubernetes checks over every child the operator renders (golden specs and
examples) and over the chart, with the documented skip list (checkov_skips.yaml).

checkov is not a project dependency (its own pins would move the shared environment):
`hack/controlplane install` puts the pinned version in a venv of its own under
$ATOM_CACHE_DIR/tools (versions.CHECKOV).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from rendered import tool, write_chart, write_children

pytestmark = pytest.mark.slow
SKIPS = yaml.safe_load((Path(__file__).parent / "checkov_skips.yaml").read_text())


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
    checkov = tool("checkov")
    write_children(tmp_path)
    _run(checkov, tmp_path, "children")


def test_chart_passes(tmp_path: Path) -> None:
    checkov = tool("checkov")
    write_chart(tmp_path, {"cluster": ["--set", "monitoring.grafanaDashboard.enabled=true"]})
    _run(checkov, tmp_path, "chart")
