"""Addons (devcluster/addons.py): a failed build fails the waiting test with the build's error,
a finished one returns at once, and the install records both (no cluster, no Go build)."""

from __future__ import annotations

import json
import time

import pytest

from atom_devtools.devcluster import addons, cache


def _fake(tmp_path, monkeypatch, install) -> addons.Addon:
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(addons.gotool, "find_go", lambda: "go")
    addon = addons.Addon("fake", cache.Component("fake", "v1", ("fake",)), install)
    monkeypatch.setitem(addons.ADDONS, "fake", addon)
    return addon


def test_a_failed_build_fails_the_wait_with_its_error(tmp_path, monkeypatch) -> None:
    def broken(_go: str) -> None:
        raise RuntimeError("link failed: out of memory\n(last lines of build.log)")

    _fake(tmp_path, monkeypatch, broken)
    with pytest.raises(addons.AddonError, match="fake: link failed"):
        addons.install(["fake"])
    start = time.monotonic()
    with pytest.raises(addons.AddonError, match="(?s)did not build.*link failed: out of memory"):
        addons.wait_installed("fake", timeout=30)
    assert time.monotonic() - start < 5  # no wait for a build that already failed


def test_an_installed_addon_is_cached_and_waits_for_nothing(tmp_path, monkeypatch) -> None:
    def build(_go: str) -> None:
        comp.bin_dir.mkdir(parents=True)
        comp.path().write_text("#!/bin/sh\n")
        comp.path().chmod(0o755)
        comp.write_stamp({"fake": "v1"})

    comp = _fake(tmp_path, monkeypatch, build).component
    assert addons.install(["fake"]) == {"fake": "installed"}
    assert addons.install(["fake"]) == {"fake": "cached"}
    assert addons.wait_installed("fake", timeout=1) == comp
    assert json.loads((comp.bin_dir / cache.STAMP).read_text())["version"] == "v1"
    assert not (tmp_path / "addons" / "fake.failed").exists()


def test_unknown_addon_is_named() -> None:
    with pytest.raises(addons.ProvisionError, match="unknown addon 'nope'; known: .*flux"):
        addons.wait_installed("nope")
