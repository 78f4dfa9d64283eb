"""The real node's parts that need no root: provisioning checks, the provisioner's volumes, the
objects the launcher creates, the images' content hash and layout pruning."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from atom_devtools import images
from atom_devtools.devcluster import ProvisionError, cache, manifests, provision, provisioner


def test_real_node_components_are_required_only_with_a_real_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATOM_CACHE_DIR", str(tmp_path))
    with pytest.raises(ProvisionError) as plain:
        provision.require()
    with pytest.raises(ProvisionError) as real:
        provision.require(real_node=True)
    for name in ("kube-node", "containerd", "coredns", "pause"):
        assert name not in str(plain.value) and name in str(real.value)
    assert provision.component_names()[0] == "debian"  # the pause image needs umoci, skopeo


def test_provisioned_volume_is_a_host_directory_on_the_real_node(tmp_path: Path) -> None:
    claim = {
        "metadata": {"name": "cache", "namespace": "ns", "uid": "u-1"},
        "spec": {"resources": {"requests": {"storage": "1Gi"}}, "accessModes": ["ReadWriteOnce"]},
    }
    pv = provisioner.volume(claim, tmp_path / "d", "atom-node", "atom-local-path", "Delete")
    assert pv["metadata"]["name"] == "pvc-u-1"
    assert pv["spec"]["hostPath"] == {"path": str(tmp_path / "d"), "type": "DirectoryOrCreate"}
    assert pv["spec"]["claimRef"]["uid"] == "u-1"
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["atom-node"]


def test_one_default_storage_class_and_dns_behind_a_selectorless_service() -> None:
    assert manifests.storage_class(default=False)["metadata"]["annotations"] == {
        "storageclass.kubernetes.io/is-default-class": "false"
    }
    local = manifests.local_path_class("atom-local-path")
    assert local["metadata"]["annotations"]["storageclass.kubernetes.io/is-default-class"] == "true"
    svc = manifests.dns_service("10.0.0.10")
    assert "selector" not in svc["spec"] and svc["spec"]["clusterIP"] == "10.0.0.10"
    eps = manifests.dns_endpoints("192.0.2.2", 10053)
    assert eps["metadata"]["labels"]["kubernetes.io/service-name"] == "kube-dns"
    assert {p["port"] for p in eps["ports"]} == {10053}


def test_context_hash_follows_the_build_context(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for rel in ("pyproject.toml", "README.md", "Dockerfile", ".dockerignore",
                "runtime/a.py", "operator/b.py"):  # fmt: skip
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    monkeypatch.setattr(images, "ROOT", tmp_path)
    first = images.context_hash()
    (tmp_path / "runtime" / "__pycache__").mkdir()
    (tmp_path / "runtime" / "__pycache__" / "a.pyc").write_text("x")
    (tmp_path / "tests.py").write_text("outside the context")
    assert images.context_hash() == first
    (tmp_path / "operator" / "b.py").write_text("changed")
    assert images.context_hash() != first


def _blob(layout: Path, doc: dict | bytes) -> dict:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def test_layout_keeps_only_the_current_tag_and_its_blobs(tmp_path: Path) -> None:
    def manifest(layer: bytes) -> dict:
        return {"config": _blob(tmp_path, b"{}" + layer), "layers": [_blob(tmp_path, layer)]}

    old, new = _blob(tmp_path, manifest(b"old")), _blob(tmp_path, manifest(b"new"))
    ref = images.REF_NAME
    index = {"manifests": [{**old, "annotations": {ref: "localhost/x:1"}},
                           {**new, "annotations": {ref: "localhost/x:2"}}]}  # fmt: skip
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert images._layout_ref(tmp_path) is None  # two tags: not one current image
    images._keep_only(tmp_path, "localhost/x:2")
    assert images._layout_ref(tmp_path) == "localhost/x:2"
    assert len(list((tmp_path / "blobs" / "sha256").iterdir())) == 3  # manifest, config, layer
    assert cache.PAUSE.binaries == ("pause", "pause.tar")
