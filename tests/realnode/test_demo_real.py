"""hack/demo's default loop on a real node: SmolLM2 from the model image answers the demo's
question from the operator's own pod, and the host is left as it was (no process, mount,
interface or iptables rule)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.realnode, pytest.mark.own_real_node, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_demo_serves_the_completion_from_the_real_pod() -> None:
    from atom_devtools.devcluster.realnode import leftovers

    if os.geteuid() != 0:
        pytest.skip("the real node needs root")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "runtime"), str(ROOT / "operator"), str(ROOT / "devtools")]))  # fmt: skip
    result = subprocess.run([sys.executable, "-m", "atom_devtools.demo", "--timeout", "600"],
                            capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)  # fmt: skip
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"atom-node\s+Ready", out), out
    assert re.search(r"Running ready=false .*\| atomd phase=(Pending|Progressing)", out), out
    assert re.search(r"model: localhost/atom-model-smollm2:\S+", out), out
    assert re.search(r"smollm2-cpu\s+3\s+NONE\s+1/1\s+Ready", out), out
    assert "models: smollm2" in out
    assert "question: What is the capital of France?" in out
    answer = re.search(r"answer:\s+(.*)", out)
    assert answer and "Paris" in answer.group(1), out  # a real model, not random weights
    assert re.search(r"finish:\s+stop, \d+ prompt \+ \d+ completion tokens", out), out
    assert re.search(
        r"served by pod smollm2-cpu-unified-\S+ \(10\.245\.0\.\d+\) on node atom-node", out
    ), out
    assert "nothing left running" in out
    match = re.search(r"kubeconfig (/\S+)/kubeconfig", out)
    assert match, out
    assert leftovers(Path(match.group(1))) == []
    assert not Path(match.group(1)).exists()
