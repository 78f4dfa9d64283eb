"""Provisioning: idempotent, version-checked, and clear about what is missing (no cluster)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from atom_devtools.devcluster import LocalCluster, ProvisionError, cache, gotool, install, versions
from atom_devtools.devcluster.provision import check_version


def test_second_install_is_fast_and_complete():
    install()  # builds whatever is missing (hack/test has done it already)
    start = time.monotonic()
    result = install()
    elapsed = time.monotonic() - start
    # the control plane, and the real node's pieces (Debian packages and pause need root)
    assert set(cache.COMPONENTS) | set(cache.NODE_COMPONENTS) - {"pause"} <= set(result)
    assert set(result.values()) == {"cached"}
    assert elapsed < 5, f"warm install took {elapsed:.1f}s"


@pytest.mark.parametrize(("binary", "args", "expect"), [
    ("kube-apiserver", ["--version"], f"Kubernetes {versions.KUBERNETES}"),
    ("kube-controller-manager", ["--version"], f"Kubernetes {versions.KUBERNETES}"),
    ("kube-scheduler", ["--version"], f"Kubernetes {versions.KUBERNETES}"),
    ("kubectl", ["version", "--client"], f"Client Version: {versions.KUBERNETES}"),
    ("etcd", ["--version"], f"etcd Version: {versions.ETCD.lstrip('v')}"),
    ("kwok", ["--version"], f"kwok version {versions.KWOK}"),
    ("helm", ["version", "--short"], versions.HELM),
])
def test_cached_binaries_report_the_pinned_versions(binary, args, expect):
    comp = next(c for c in cache.COMPONENTS.values() if binary in c.binaries)
    out = subprocess.run([str(comp.path(binary)), *args], capture_output=True, text=True,
                         timeout=60)
    assert expect in out.stdout + out.stderr


def test_missing_binaries_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    with pytest.raises(ProvisionError) as err:
        LocalCluster().start()
    message = str(err.value)
    for name in cache.COMPONENTS:
        assert name in message
    assert "hack/controlplane install" in message
    assert str(tmp_path) in message


def test_install_without_go_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(gotool, "GO_FALLBACKS", ())
    with pytest.raises(ProvisionError, match="go not found"):
        install(["etcd"])


def test_stamp_detects_a_changed_or_wrong_version_binary(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    comp = cache.Component("tool", "v1.0.0", ("tool",))
    comp.bin_dir.mkdir(parents=True)
    comp.path().write_text("#!/bin/sh\necho tool v1.0.0\n")
    comp.path().chmod(0o755)
    assert not comp.is_installed()  # no stamp yet
    comp.write_stamp({})
    assert comp.is_installed()
    assert not cache.Component("tool", "v2.0.0", ("tool",)).is_installed()
    with comp.path().open("a") as fh:
        fh.write("# truncated or replaced\n")
    assert not comp.is_installed()


def test_version_check_rejects_a_binary_of_another_version(tmp_path: Path):
    fake = tmp_path / "kube-apiserver"
    fake.write_text("#!/bin/sh\necho 'Kubernetes v0.0.0-master+$Format:%H$'\n")
    fake.chmod(0o755)
    with pytest.raises(ProvisionError, match=r"kube-apiserver reports the wrong version"):
        check_version(fake, ["--version"], "Kubernetes v1.36.3")
    assert check_version(fake, ["--version"], "Kubernetes v0.0.0").startswith("Kubernetes")
