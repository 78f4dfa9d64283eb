"""spec.speculative: typed, CEL-guarded, rendered into --speculative-config for the unified and
decode roles (never prefill), and part of the compile-cache key."""

from __future__ import annotations

import pydantic
import pytest
import yaml
from atomd_helpers import SPECS, spec

from atom.cli.args import build_parser
from atom.cli.config import config_from_args
from atom_operator import crdgen, runtime_args

SELF = {"method": "draft_model", "numSpeculativeTokens": 3, "draftModel": "llama-3.2-1b"}
NGRAM = {
    "method": "ngram",
    "numSpeculativeTokens": 2,
    "ngram": {"promptLookupMin": 2, "promptLookupMax": 4},
}


def _runtime_spec(s, role: str):
    ns = build_parser().parse_args(runtime_args.render_args(s, role, cache_dir=None))
    return config_from_args(ns).speculative_config


def test_rendered_for_unified_and_decode_not_prefill() -> None:
    got = _runtime_spec(spec("unified", speculative=SELF), "unified")
    assert (got.method, got.k, got.model) == ("draft_model", 3, "llama-3.2-1b")
    got = _runtime_spec(spec("unified", speculative=NGRAM), "unified")
    assert (got.k, got.prompt_lookup_min, got.prompt_lookup_max) == (2, 2, 4)
    disagg = next(n for n, b in SPECS.items() if "disaggregation" in b)
    s = spec(disagg, speculative=NGRAM)
    assert _runtime_spec(s, "decode").k == 2
    assert _runtime_spec(s, "prefill") is None
    assert "--speculative-config" not in runtime_args.render_args(
        spec("unified"), "unified", cache_dir=None
    )


def test_compile_cache_key_follows_k_and_method() -> None:
    keys = {
        runtime_args.cache_key(spec("unified", speculative=sp), "unified", "img")
        for sp in (None, SELF, {**SELF, "numSpeculativeTokens": 5}, NGRAM)
    }
    assert len(keys) == 4


def test_model_refuses_bad_values() -> None:
    with pytest.raises(pydantic.ValidationError):
        spec("unified", speculative={"method": "ngram", "numSpeculativeTokens": 0})
    with pytest.raises(pydantic.ValidationError):
        spec("unified", speculative={"method": "ngram", "numSpeculativeTokens": 16})
    with pytest.raises(pydantic.ValidationError):
        spec("unified", speculative={"method": "eagle", "numSpeculativeTokens": 1})


def test_crd_carries_the_cel_rules() -> None:
    crd = yaml.safe_load(crdgen.CRD_PATH.read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    sp = root["properties"]["speculative"]
    assert sp["properties"]["method"]["enum"] == ["ngram", "draft_model"]
    assert sp["properties"]["numSpeculativeTokens"]["maximum"] == 15
    rules = {r["rule"] for r in sp["x-kubernetes-validations"]}
    assert "self.method != 'draft_model' || has(self.draftModel)" in rules
    assert "self.method == 'ngram' || !has(self.ngram)" in rules
    window = sp["properties"]["ngram"]["x-kubernetes-validations"][0]["rule"]
    assert "self.promptLookupMin <= self.promptLookupMax" in window
    chart = crdgen.CRD_PATH.parents[1] / "charts" / "atom-operator" / "crds" / "atomdeployment.yaml"
    assert chart.read_text() == crdgen.CRD_PATH.read_text()
