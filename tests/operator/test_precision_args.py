"""spec.quantization and spec.kvCacheDtype (issue 47): rendered into every runtime role's
command line only when set, parsed by the runtime's own parser, in the compile-cache key; and
the decode role's FULL_DECODE_ONLY default next to them (a role override wins)."""

from __future__ import annotations

import pytest
from atomd_helpers import SPECS, spec

from atom.cli.args import build_parser
from atom.cli.config import config_from_args
from atom_operator import runtime_args


def _parsed(s, role: str):
    return build_parser().parse_args(runtime_args.render_args(s, role, cache_dir=None))


@pytest.mark.parametrize("name", ["disaggregated", "full-decode-only"])
def test_fp8_fields_render_for_every_role_and_key_the_cache(name: str) -> None:
    plain = spec(name)
    fp8 = spec(name, quantization="fp8", kvCacheDtype="fp8")
    for role in runtime_args.roles(plain):
        args = runtime_args.render_args(plain, role, cache_dir=None)
        assert "--quantization" not in args and "--kv-cache-dtype" not in args  # as before
        ns = _parsed(fp8, role)
        assert (ns.quantization, ns.kv_cache_dtype) == ("fp8", "fp8")
        config = config_from_args(ns)
        assert (config.quantization, config.kv_cache_dtype) == ("fp8", "fp8")
        keys = {runtime_args.cache_key(s, role, "img") for s in (
            plain, fp8, spec(name, quantization="fp8"), spec(name, kvCacheDtype="fp8"))}
        assert len(keys) == 4
        assert runtime_args.cache_key(spec(name, quantization="none"), role, "img") == \
            runtime_args.cache_key(plain, role, "img")  # the defaults keep existing keys


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError):
        spec("disaggregated", quantization="int4")
    with pytest.raises(ValueError):
        spec("disaggregated", kvCacheDtype="fp16")


def test_decode_role_runs_full_decode_only_unless_its_override_says_otherwise() -> None:
    body = SPECS["disaggregated"]
    assert _parsed(spec(body), "decode").cudagraph_mode == "FULL_DECODE_ONLY"
    override = {**body, "disaggregation": {**body["disaggregation"], "decode": {
        "replicas": 2, "compilation": {"cudagraphMode": "FULL"}}}}
    assert _parsed(spec(override), "decode").cudagraph_mode == "FULL"
    assert _parsed(spec(override), "prefill").cudagraph_mode == "TR_HYBRID"
