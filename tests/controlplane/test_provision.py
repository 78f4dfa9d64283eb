"""Provisioning: idempotent, version-checked, and clear about what is missing (no cluster)."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from pathlib import Path

import pytest

from atom_devtools.devcluster import LocalCluster, ProvisionError, cache, gotool, install, versions
from atom_devtools.devcluster.build import check_version
from atom_devtools.devcluster.provision import component_names

ROOT = Path(__file__).resolve().parents[2]


def test_second_install_is_fast_and_complete():
    install()  # builds whatever is missing (hack/test has done it already)
    start = time.monotonic()
    result = install()
    elapsed = time.monotonic() - start
    # the control plane, the real node's pieces (Debian packages and pause need root), linters
    wanted = set(cache.COMPONENTS) | set(cache.NODE_COMPONENTS) | set(cache.LINT_COMPONENTS)
    assert wanted - {"pause"} <= set(result)
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
    ("kubeconform", ["-v"], versions.KUBECONFORM),
    ("checkov", ["--version"], versions.CHECKOV),
])
def test_cached_binaries_report_the_pinned_versions(binary, args, expect):
    comps = cache.COMPONENTS | cache.LINT_COMPONENTS
    comp = next(c for c in comps.values() if binary in c.binaries)
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


def test_linters_are_components_outside_the_repository_and_not_needed_by_the_cluster():
    for name in ("kubeconform", "checkov"):
        assert name in component_names()
        assert name not in cache.COMPONENTS  # LocalCluster's precondition stays the control plane
    help_text = subprocess.run([str(ROOT / "hack" / "controlplane"), "install", "--help"],
                               capture_output=True, text=True, check=True).stdout
    assert "kubeconform" in help_text and "checkov" in help_text
    # checkov lives in its own venv under the cache (hack/test installed it), not in .venv
    venv = cache.CHECKOV.venv_dir
    assert venv == cache.cache_dir() / "tools" / f"checkov-{versions.CHECKOV}"
    assert not venv.is_relative_to(ROOT)
    where = subprocess.run([str(cache.CHECKOV.path("python")), "-c",
                            "import checkov, sys; print(sys.prefix)"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where) == venv
    assert importlib.util.find_spec("checkov") is None, "checkov leaked into the project's venv"


def test_checkov_venv_stamp_detects_a_lost_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path / "cache"))
    comp = cache.VenvComponent("tool", "1.0", ("tool", "python"))
    comp.bin_dir.mkdir(parents=True)
    base = tmp_path / "python3.11"
    base.write_text("#!/bin/sh\n")
    base.chmod(0o755)
    comp.path("python").symlink_to(base)
    comp.path().write_text(f"#!{comp.path('python')}\n")
    comp.path().chmod(0o755)
    assert comp.bin_dir == tmp_path / "cache" / "tools" / "tool-1.0" / "bin"
    assert not comp.is_installed()  # no stamp yet: a half-made venv does not count
    comp.write_stamp({})
    assert comp.is_installed()
    base.unlink()  # the base interpreter went away (a Python upgrade): the venv is dead
    assert not comp.is_installed()


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
