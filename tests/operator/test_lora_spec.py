"""spec.lora: adapters from an image or a claim become read-only volumes at /lora/<name> and
the runtime's --lora-modules (which the runtime's own parser accepts and turns into its
LoRAConfig); the CRD refuses an adapter with no source or two."""

from __future__ import annotations

from typing import Any

from atomd_helpers import IMAGE, OWNER, spec
from test_crd_rules import violations

from atom.cli.args import build_parser
from atom.cli.config import lora_from_args
from atom.lora import LoRAConfig
from atom_operator import builders, runtime_args

REF = "localhost/atom-model-smollm2:0.1.2"
BASE: dict[str, Any] = {"device": "cpu", "model": {"name": "m", "image": {"reference": REF}}}
LORA = {
    "adapters": [
        {"name": "french", "image": {"reference": "localhost/lora-fr:1", "path": "adapter",
                                     "pullPolicy": "Never"}},
        {"name": "sql", "claim": {"name": "adapters", "path": "/sql/v2"}},
    ],
    "maxLoras": 4,
    "maxLoraRank": 32,
}


def test_adapters_render_volumes_mounts_and_flags() -> None:
    s = spec({**BASE, "lora": LORA})
    pod = builders.runtime.pod_spec(OWNER, s, "unified", IMAGE, "k")
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["lora-french"] == {"name": "lora-french", "image": {
        "reference": "localhost/lora-fr:1", "pullPolicy": "Never"}}
    assert volumes["lora-sql"] == {"name": "lora-sql", "persistentVolumeClaim": {
        "claimName": "adapters", "readOnly": True}}
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["lora-french"] == {"name": "lora-french", "mountPath": "/lora/french",
                                     "readOnly": True}
    assert mounts["lora-sql"]["mountPath"] == "/lora/sql"
    args = runtime_args.render_args(s, "unified", cache_dir=None)
    assert args[args.index("--lora-modules") + 1:][:2] == [
        "french=/lora/french/adapter", "sql=/lora/sql/sql/v2"]
    # the runtime's parser takes the rendered flags as they are
    assert lora_from_args(build_parser().parse_args(args)) == LoRAConfig(
        modules={"french": "/lora/french/adapter", "sql": "/lora/sql/sql/v2"},
        max_loras=4, max_lora_rank=32)


def test_no_adapters_enables_runtime_loading_and_unset_renders_nothing() -> None:
    args = runtime_args.render_args(spec({**BASE, "lora": {}}), "unified", cache_dir=None)
    assert "--enable-lora" in args and "--lora-modules" not in args
    plain = spec(BASE)
    assert not [a for a in runtime_args.render_args(plain, "unified", cache_dir=None)
                if "lora" in a]
    pod = builders.runtime.pod_spec(OWNER, plain, "unified", IMAGE, "k")
    assert not [v for v in pod["volumes"] if v["name"].startswith("lora-")]


def test_the_crd_wants_exactly_one_source_per_adapter() -> None:
    ok = {**BASE, "lora": LORA}
    assert not [v for v in violations(ok) if "LoRA" in v[1]]
    none = {**BASE, "lora": {"adapters": [{"name": "x"}]}}
    both = {**BASE, "lora": {"adapters": [{"name": "x", "image": {"reference": REF},
                                           "claim": {"name": "c"}}]}}
    for bad in (none, both):
        assert any("exactly one of image or claim" in msg for _, msg in violations(bad))
