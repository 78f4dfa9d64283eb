"""Contract: every rendered command line parses with the runtime's own parser."""

from __future__ import annotations

import itertools
import json

import pytest
from atomd_helpers import SPECS, spec

from atom.cli.args import build_parser
from atom_operator import runtime_args
from atom_operator.models import GRAPH_MODES


def parse(args: list[str]):
    return build_parser().parse_args(args)


@pytest.mark.parametrize("level,mode", list(itertools.product([0, 1, 2, 3], GRAPH_MODES)))
def test_every_mode_at_every_level_parses(level: int, mode: str) -> None:
    s = spec(
        "unified",
        compilation={"level": level, "cudagraphMode": mode, "cudagraphCaptureSizes": [1, 2, 4]},
    )
    ns = parse(runtime_args.render_args(s, "unified", cache_dir="/var/cache/atom/k"))
    assert ns.level == level and ns.cudagraph_mode == mode
    # sizes under NONE are accepted by the CRD and ignored: not rendered
    assert ns.cudagraph_capture_sizes == (None if mode == "NONE" else [1, 2, 4])
    assert ns.compile_cache_dir == "/var/cache/atom/k"


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("command", ["serve", "warmup"])
def test_golden_specs_parse_for_every_role(name: str, command: str) -> None:
    s = spec(name)
    for role in runtime_args.roles(s):
        ns = parse(runtime_args.render_args(s, role, cache_dir=None, command=command))
        assert ns.command == command and ns.role == role
        assert ns.max_num_seqs == s.engine.max_num_seqs
        assert ns.compile_cache_dir is None


def test_model_path_and_served_name() -> None:
    ns = parse(runtime_args.render_args(spec("disaggregated"), "prefill", cache_dir=None))
    assert ns.model == "/models/qwen3" and ns.served_model_name == "qwen3-0.6b"
    assert ns.kv_port == 8001 and ns.max_model_len == 2048


def test_extra_compilation_fields_go_through_json() -> None:
    ns = parse(runtime_args.render_args(spec("custom-sizes"), "unified", cache_dir=None))
    assert ns.compilation_config == {
        "splitting_ops": ["aiter.unified_attention_with_output"],
        "compile_sizes": ["cudagraph_capture_sizes"],
        "inductor_compile_config": {"max_autotune": True},
    }
    assert ns.cudagraph_capture_sizes == [1, 2, 4, 8, 16]  # sorted: set semantics


def test_decode_defaults_to_full_decode_only_prefill_inherits() -> None:
    s = spec("disaggregated")
    assert (
        parse(runtime_args.render_args(s, "decode", cache_dir=None)).cudagraph_mode
        == "FULL_DECODE_ONLY"
    )
    assert (
        parse(runtime_args.render_args(s, "prefill", cache_dir=None)).cudagraph_mode == "TR_HYBRID"
    )


def test_role_override_merges_onto_shared() -> None:
    body = json.loads(json.dumps(SPECS["disaggregated"]))
    body["disaggregation"]["decode"]["compilation"] = {
        "cudagraphMode": "FULL",
        "cudagraphCaptureSizes": [1, 8],
    }
    body["disaggregation"]["prefill"]["compilation"] = {"level": 0}
    s = spec(body)
    dec = parse(runtime_args.render_args(s, "decode", cache_dir=None))
    pre = parse(runtime_args.render_args(s, "prefill", cache_dir=None))
    assert (dec.level, dec.cudagraph_mode, dec.cudagraph_capture_sizes) == (3, "FULL", [1, 8])
    assert (pre.level, pre.cudagraph_mode) == (0, "TR_HYBRID")


def test_startup_budget_grows_with_level_and_sizes() -> None:
    def budget(level: int, sizes: list[int]) -> int:
        s = spec(
            "unified",
            compilation={"level": level, "cudagraphMode": "FULL", "cudagraphCaptureSizes": sizes},
        )
        return runtime_args.startup_budget_seconds(s, "unified")

    assert budget(0, [1]) < budget(1, [1]) < budget(2, [1]) < budget(3, [1])
    assert budget(3, [1]) < budget(3, [1, 2, 4, 8]) < budget(3, list(range(1, 65)))


def test_default_capture_sizes_follow_the_guide_capped_by_max_num_seqs() -> None:
    s = spec("unified", engine={"maxNumSeqs": 40})
    comp = runtime_args.effective_compilation(s, "unified")
    assert runtime_args.capture_sizes(s, comp) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]
