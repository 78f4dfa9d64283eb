"""The newcomer demo (hack/demo's Python part) runs the whole loop and leaves nothing behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# The kwok-only loop (tests/realnode/test_demo_real.py runs the default, real-node one).
DEMO = [sys.executable, "-m", "atom_devtools.demo", "--kwok", "--timeout", "240"]


@pytest.fixture(autouse=True)
def control_plane_installed() -> None:
    from atom_devtools.devcluster.cache import missing

    if missing():
        pytest.skip(f"control-plane binaries missing: {missing()} (hack/controlplane install)")


def processes_mentioning(text: str) -> list[int]:
    """Live pids whose command line contains `text` (the cluster's private directory)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def cluster_dir(output: str) -> str:
    match = re.search(r"kubeconfig (/\S+)/kubeconfig", output)
    assert match, f"the demo did not say where its cluster lives:\n{output}"
    return match.group(1)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_runs_the_whole_loop() -> None:
    result = subprocess.run(DEMO, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert re.search(r"llama-unified\s+3\s+TR_HYBRID\s+1/1\s+Ready", out), out
    assert "deployment.apps/llama-unified-unified" in out
    assert "/health -> 200" in out
    assert "models: tiny-llama" in out
    assert re.search(r"finish:\s+length, \d+ prompt \+ 16 completion tokens", out), out
    assert "nothing left running" in out
    assert processes_mentioning(cluster_dir(out)) == []
    assert not Path(cluster_dir(out)).exists(), "the cluster directory should be removed"


def test_ctrl_c_tears_everything_down() -> None:
    """Started with SIGINT ignored, as a background job of a non-interactive shell (or a CI
    runner) starts it: Python then keeps ignoring SIGINT unless the demo installs its handler,
    and the demo would run to the end instead of tearing down (this test's one flaky failure)."""
    demo = subprocess.Popen(
        DEMO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    lines: list[str] = []
    assert demo.stdout is not None
    try:
        deadline = time.monotonic() + 300
        for line in demo.stdout:
            lines.append(line)
            if "Waiting for atomd/" in line or time.monotonic() > deadline:
                break
        operator_pid = int(re.search(r"pid (\d+), /healthz", "".join(lines)).group(1))  # type: ignore[union-attr]
        assert pid_alive(operator_pid)
        demo.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal delivers
        rest, _ = demo.communicate(timeout=90)
    finally:
        if demo.poll() is None:
            demo.kill()
    out = "".join(lines) + rest
    assert demo.returncode == 130, out
    assert "interrupted" in out and "nothing left running" in out, out
    assert not pid_alive(operator_pid)
    assert processes_mentioning(cluster_dir(out)) == []
