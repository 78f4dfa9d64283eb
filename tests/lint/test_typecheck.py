"""mypy ([tool.mypy] in pyproject.toml) over runtime/atom, operator/ and devtools/: the tree is
clean, and a wrong argument across a seam (the engine's Config, an operator builder's spec) is
an error, in an annotated function and in an unannotated one alike (check_untyped_defs).

hack/test runs the same check before pytest; both share mypy's incremental cache (outside the
tree: $MYPY_CACHE_DIR, else ~/.cache/atom/mypy), so a warm run takes seconds.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# One mypy at a time: both runs write the same cache.
pytestmark = pytest.mark.xdist_group("mypy")

SNIPPET = '''\
from atom.config import Config
from atom.engine.llm_engine import LLMEngine
from atom_operator.builders import cache_keys
from atom_operator.spec import AtomDeploymentSpec


def right(config: Config, spec: AtomDeploymentSpec) -> None:
    LLMEngine(config)
    cache_keys(spec, "registry/atom:1")


def wrong(config: Config, spec: AtomDeploymentSpec) -> None:
    LLMEngine(config.model)  # line 13: the model path where the Config goes
    cache_keys("registry/atom:1", spec)  # line 14: the arguments swapped


def untyped(spec):
    LLMEngine("/models/llama")  # line 18
'''
# (line, code) of every error mypy must report in the snippet, and no other.
EXPECTED = {(13, "arg-type"), (14, "arg-type"), (18, "arg-type")}
ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def _mypy(*files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"), *files],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )


def test_wrong_argument_across_a_seam_is_an_error(tmp_path: Path) -> None:
    snippet = tmp_path / "seam_snippet.py"
    snippet.write_text(SNIPPET)
    result = _mypy(str(snippet))
    found = set()
    for line in result.stdout.splitlines():
        m = ERROR.match(line)
        if m and Path(m["path"]).name == snippet.name:
            found.add((int(m["line"]), m["code"]))
    assert found == EXPECTED, result.stdout + result.stderr
    assert result.returncode == 1


@pytest.mark.slow
def test_tree_is_clean() -> None:
    result = _mypy()
    assert result.returncode == 0, result.stdout + result.stderr
