"""The launcher starts fast, reports failures with logs, and never leaves a process behind."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atom_devtools.devcluster import ClusterError, LocalCluster, cache

REPO = Path(__file__).resolve().parents[2]


def _processes_mentioning(text: str) -> list[int]:
    """Pids whose command line contains `text` (each component is given its temp dir)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(entry.name))
    return pids


def test_cluster_starts_fast_and_stops_clean():
    with LocalCluster(nodes=1) as local:
        workdir = str(local.dir)
        assert local.started_in is not None and local.started_in < 30
        assert local.kubectl("get", "node", "kwok-node-0").returncode == 0
        assert len(_processes_mentioning(workdir)) == 5  # etcd, apiserver, kcm, scheduler, kwok
    assert _processes_mentioning(workdir) == []
    assert not Path(workdir).exists()


def test_startup_failure_shows_the_log_and_leaves_nothing(tmp_path, monkeypatch):
    real = {name: c.bin_dir for name, c in cache.COMPONENTS.items()}
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "cache"))
    for name, comp in cache.COMPONENTS.items():
        comp.bin_dir.mkdir(parents=True)
        for binary in comp.binaries:
            comp.path(binary).symlink_to(real[name] / binary)
    (cache.kwok_stages_dir()).symlink_to(real["kwok"] / "stages")
    broken = cache.KUBERNETES.path("kube-apiserver")
    broken.unlink()
    broken.write_text("#!/bin/sh\necho 'boom: refusing to serve' >&2\nexit 3\n")
    broken.chmod(0o755)
    for comp in cache.COMPONENTS.values():
        comp.write_stamp({})

    with pytest.raises(ClusterError) as err:
        LocalCluster(timeout=60).start()
    message = str(err.value)
    assert "kube-apiserver exited with 3" in message
    assert "boom: refusing to serve" in message
    logs = re.search(r"logs kept in (\S+)\)", message)
    assert logs, message
    workdir = str(Path(logs[1]).parent)
    assert _processes_mentioning(workdir) == []  # etcd, started first, is gone too
    assert (Path(logs[1]) / "etcd.log").is_file()
    shutil.rmtree(workdir)


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what a shell does to `cmd &`


def _start_cli(*args: str, sigint_ignored: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen([str(REPO / "hack" / "controlplane"), "up", "--nodes", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            preexec_fn=_ignore_sigint if sigint_ignored else None)


def test_cli_up_check_shows_nodes_and_exits():
    proc = _start_cli("--check")
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 0, out
    assert re.search(r"kwok-node-0\s+Ready", out), out
    workdir = str(Path(re.search(r"kubeconfig: (\S+)", out)[1]).parent)
    assert _processes_mentioning(workdir) == []


@pytest.mark.parametrize(("sig", "sigint_ignored"), [
    (signal.SIGINT, False), (signal.SIGTERM, False), (signal.SIGINT, True)])
def test_cli_up_stops_everything_on_signal(sig, sigint_ignored):
    proc = _start_cli(sigint_ignored=sigint_ignored)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if "Ctrl-C stops it" in line:
            break
    else:
        pytest.fail("".join(lines))
    workdir = str(Path(re.search(r"kubeconfig: (\S+)", "".join(lines))[1]).parent)
    assert len(_processes_mentioning(workdir)) == 5
    proc.send_signal(sig)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert _processes_mentioning(workdir) == []
    assert not Path(workdir).exists()


def test_children_die_with_a_killed_launcher(tmp_path):
    # SIGKILL gives no chance to clean up: the parent-death signal must take the children.
    script = ("import sys, time\nfrom atom_devtools.devcluster import LocalCluster\n"
              "c = LocalCluster(nodes=1); c.start(); print(c.dir, flush=True); time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            stderr=subprocess.DEVNULL,
                            env=dict(os.environ, PYTHONPATH=str(REPO / "devtools")))
    assert proc.stdout is not None
    workdir = proc.stdout.readline().strip()
    assert workdir and len(_processes_mentioning(workdir)) == 5
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _processes_mentioning(workdir) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(workdir) == []
    shutil.rmtree(workdir)  # nobody was left to remove it
