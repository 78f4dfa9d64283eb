"""The compile prefetch thread: does Inductor's per-process set-up, and is off when nothing
will be compiled."""

from __future__ import annotations

import subprocess
import sys

import pytest

from atom.compilation.prefetch import CompilePrefetch

# A fresh interpreter, so that the imports are really done by the thread.
PROBE = """
import sys, threading
from atom.compilation.prefetch import CompilePrefetch
assert "torch._inductor.compile_fx" not in sys.modules
p = CompilePrefetch("cpu", enabled={enabled})
threads = [t.name for t in threading.enumerate()]
p.wait()
print("compile_fx" if "torch._inductor.compile_fx" in sys.modules else "none",
      "thread" if "atom-compile-prefetch" in threads else "nothread", p.seconds > 0)
"""


@pytest.mark.parametrize(("enabled", "expected"), [
    (True, "compile_fx thread True"),
    (False, "none nothread False"),
])
def test_prefetch_imports_inductor_only_when_enabled(enabled: bool, expected: str) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE.format(enabled=enabled)],
                         capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.split("\n")[-2] == expected


def test_wait_is_idempotent() -> None:
    p = CompilePrefetch("cpu", enabled=True)
    p.wait()
    p.wait()
    assert p.seconds > 0
