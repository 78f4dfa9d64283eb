"""atom.config against the guide: defaults, level-3 setup, capture sizes, modes, validation."""

from __future__ import annotations

import dataclasses

import pytest

from atom.config import (
    CompilationConfig,
    CompilationLevel,
    Config,
    CUDAGraphMode,
    default_capture_sizes,
)

DEFAULT_OPS = ["aiter.unified_attention_with_output", "aiter.mla_attention"]


def test_compilation_config_defaults_match_the_guide_table() -> None:
    cc = CompilationConfig()
    expected = {
        "level": 0,
        "use_cudagraph": True,
        "cudagraph_capture_sizes": None,
        "cuda_graph_sizes": [512],
        "cudagraph_mode": None,
        "splitting_ops": None,
        "cudagraph_copy_inputs": False,
        "use_inductor": True,
        "compile_sizes": None,
        "inductor_compile_config": {},
        "debug_dump_path": "",
        "cache_dir": "",
    }
    for name, value in expected.items():
        assert getattr(cc, name) == value, name
    # Every field of the guide's table exists (and no default list is shared).
    assert CompilationConfig().cuda_graph_sizes is not cc.cuda_graph_sizes


def test_config_related_fields_defaults() -> None:
    fields = {f.name: f for f in dataclasses.fields(Config)}
    assert fields["enforce_eager"].default is False
    assert fields["capture_sizes"].default is None
    cfg = Config()
    assert isinstance(cfg.compilation_config, CompilationConfig)
    assert cfg.compilation_config.level == CompilationLevel.NO_COMPILATION
    # Level 0 with no mode chosen: no graphs, nothing to capture.
    assert cfg.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert cfg.capture_sizes == []


def test_levels_and_modes_have_the_guide_values() -> None:
    assert [int(lv) for lv in CompilationLevel] == [0, 1, 2, 3]
    assert [lv.name for lv in CompilationLevel] == ["NO_COMPILATION", "DYNAMO_AS_IS", "DYNAMO_ONCE", "PIECEWISE"]
    assert CUDAGraphMode.NONE.value == 0
    assert CUDAGraphMode.TR_HYBRID.value == 1
    assert CUDAGraphMode.FULL.value == 2
    assert CUDAGraphMode.FULL_DECODE_ONLY.value == (2, 0)
    assert CUDAGraphMode.FULL_AND_TR_HYBRID.value == (2, 1)


@pytest.mark.parametrize(
    "mode, decode, mixed, separate, full, tr, top",
    [
        ("NONE", "NONE", "NONE", False, False, False, "NONE"),
        ("TR_HYBRID", "TR_HYBRID", "TR_HYBRID", False, False, True, "TR_HYBRID"),
        ("FULL", "FULL", "FULL", False, True, False, "FULL"),
        ("FULL_DECODE_ONLY", "FULL", "NONE", True, True, False, "FULL"),
        ("FULL_AND_TR_HYBRID", "FULL", "TR_HYBRID", True, True, True, "FULL"),
    ],
)
def test_cudagraph_mode_helpers(mode: str, decode: str, mixed: str, separate: bool, full: bool, tr: bool, top: str) -> None:
    m = CUDAGraphMode[mode]
    assert m.decode_mode() is CUDAGraphMode[decode]
    assert m.mixed_mode() is CUDAGraphMode[mixed]
    assert m.separate_routine() is separate
    assert m.has_full_cudagraphs() is full
    assert m.uses_tr_hybrid() is tr
    assert m.max_cudagraph_mode() is CUDAGraphMode[top]


@pytest.mark.parametrize(
    "text, mode",
    [
        ("full_decode_only", CUDAGraphMode.FULL_DECODE_ONLY),
        ("FULL_AND_TR_HYBRID", CUDAGraphMode.FULL_AND_TR_HYBRID),
        ("tr-hybrid", CUDAGraphMode.TR_HYBRID),
        ("None", CUDAGraphMode.NONE),
        (2, CUDAGraphMode.FULL),
        ((2, 0), CUDAGraphMode.FULL_DECODE_ONLY),
        ([2, 1], CUDAGraphMode.FULL_AND_TR_HYBRID),
    ],
)
def test_cudagraph_mode_parse(text: object, mode: CUDAGraphMode) -> None:
    assert CUDAGraphMode.parse(text) is mode
    assert CompilationConfig(cudagraph_mode=text).cudagraph_mode is mode


def test_default_production_setup_level3() -> None:
    cc = CompilationConfig(level=3)
    cfg = Config(compilation_config=cc)
    assert cc.splitting_ops == DEFAULT_OPS
    assert cc.cudagraph_mode is CUDAGraphMode.TR_HYBRID
    assert cc.cuda_graph_sizes == [512]
    expected = [1, 2, 3, 4, 5, 6, 7, 8] + list(range(16, 513, 16))
    assert cfg.capture_sizes == expected
    assert cc.cudagraph_capture_sizes == expected
    assert cfg.capture_sizes[:10] == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32] and cfg.capture_sizes[-2:] == [496, 512]
    assert cc.compile_sizes == []


def test_set_splitting_ops_for_v1_keeps_a_user_choice() -> None:
    cc = CompilationConfig()
    cc.set_splitting_ops_for_v1()
    assert cc.splitting_ops == DEFAULT_OPS
    mine = CompilationConfig(level=3, splitting_ops=["aiter.my_op"])
    Config(compilation_config=mine)
    assert mine.splitting_ops == ["aiter.my_op"]


def test_custom_capture_sizes() -> None:
    cfg = Config(compilation_config=CompilationConfig(level=3, cudagraph_capture_sizes=[8, 1, 4, 2]))
    assert cfg.capture_sizes == [1, 2, 4, 8]  # ascending


def test_explicit_mode_is_kept_at_level3() -> None:
    cfg = Config(compilation_config=CompilationConfig(level=3, cudagraph_mode="FULL_DECODE_ONLY"))
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.FULL_DECODE_ONLY


@pytest.mark.parametrize("n", [1, 8, 15, 16, 17, 100, 512])
def test_capture_size_pattern(n: int) -> None:
    sizes = default_capture_sizes(n)
    assert sizes[:8] == list(range(1, 9))
    tail = sizes[8:]
    assert all(s % 16 == 0 and 16 <= s <= n for s in tail)
    assert len(tail) == n // 16


def test_generated_sizes_are_clamped_to_max_num_seqs() -> None:
    cfg = Config(max_num_seqs=40, compilation_config=CompilationConfig(level=3))
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]
    small = Config(max_num_seqs=5, compilation_config=CompilationConfig(level=3))
    assert small.capture_sizes == [1, 2, 3, 4, 5]


def test_several_cuda_graph_sizes_are_used_directly() -> None:
    cfg = Config(compilation_config=CompilationConfig(level=3, cuda_graph_sizes=[4, 2, 64]))
    assert cfg.capture_sizes == [2, 4, 64]


def test_graph_mode_is_independent_of_level() -> None:
    cfg = Config(max_num_seqs=20, compilation_config=CompilationConfig(level=0, cudagraph_mode="FULL"))
    assert cfg.compilation_config.level == 0
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.FULL
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    lvl2 = Config(compilation_config=CompilationConfig(level=2))
    assert lvl2.compilation_config.cudagraph_mode is CUDAGraphMode.NONE
    assert lvl2.compilation_config.splitting_ops is None  # only level 3 splits


def test_sizes_under_mode_none_are_ignored_not_refused() -> None:
    cfg = Config(
        max_num_seqs=4,
        compilation_config=CompilationConfig(level=3, cudagraph_mode="NONE", cudagraph_capture_sizes=[64]),
    )
    assert cfg.capture_sizes == []


def test_use_cudagraph_false_means_no_graphs() -> None:
    cfg = Config(compilation_config=CompilationConfig(level=3, use_cudagraph=False))
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.NONE
    assert cfg.capture_sizes == []


def test_enforce_eager_skips_compilation_and_graphs() -> None:
    cfg = Config(enforce_eager=True, compilation_config=CompilationConfig(level=3, cudagraph_mode="FULL"))
    assert cfg.compilation_config.level == CompilationLevel.NO_COMPILATION
    assert cfg.compilation_config.cudagraph_mode is CUDAGraphMode.NONE
    assert cfg.capture_sizes == []


def test_compile_sizes_expand_capture_sizes_keyword() -> None:
    cc = CompilationConfig(level=3, cudagraph_capture_sizes=[1, 2, 4], compile_sizes=["cudagraph_capture_sizes", 64, 2])
    Config(compilation_config=cc)
    assert cc.compile_sizes == [1, 2, 4, 64]
    direct = CompilationConfig(compile_sizes=[8, "cudagraph_capture_sizes"])
    direct.init_with_cudagraph_sizes([3, 1])
    assert direct.cudagraph_capture_sizes == [1, 3]
    assert direct.compile_sizes == [1, 3, 8]


def test_from_dict_accepts_camel_case_and_refuses_unknown_keys() -> None:
    cc = CompilationConfig.from_dict({"level": 3, "cudagraphMode": "FULL", "cudagraphCaptureSizes": [1, 2]})
    assert cc.level == 3 and cc.cudagraph_mode is CUDAGraphMode.FULL and cc.cudagraph_capture_sizes == [1, 2]
    with pytest.raises(ValueError, match="no field 'bogus'.*allowed:.*cache_dir"):
        CompilationConfig.from_dict({"bogus": 1})
    cfg = Config(compilation_config={"level": 3, "cuda_graph_sizes": [32]})
    assert cfg.capture_sizes == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]


def test_hash_factors_leave_out_paths() -> None:
    a = CompilationConfig(level=3, cache_dir="/a", debug_dump_path="/d1").hash_factors()
    b = CompilationConfig(level=3, cache_dir="/b", debug_dump_path="/d2").hash_factors()
    assert a == b
    assert "cache_dir" not in a and "debug_dump_path" not in a
    assert a != CompilationConfig(level=3, use_inductor=False).hash_factors()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"level": 7}, r"compilation_config\.level must be one of 0 \(NO_COMPILATION\), 1 \(DYNAMO_AS_IS\), 2 \(DYNAMO_ONCE\), 3 \(PIECEWISE\), got 7"),
        ({"level": -1}, r"compilation_config\.level must be one of .*got -1"),
        ({"cudagraph_mode": "PIECEWISE_PLUS"}, r"compilation_config\.cudagraph_mode must be one of NONE, TR_HYBRID, FULL, FULL_DECODE_ONLY, FULL_AND_TR_HYBRID, got 'PIECEWISE_PLUS'"),
        ({"cudagraph_mode": 5}, r"compilation_config\.cudagraph_mode must be one of .*got 5"),
        ({"cudagraph_capture_sizes": [1, 0]}, r"compilation_config\.cudagraph_capture_sizes entries must be positive integers \(>= 1\), got 0"),
        ({"cudagraph_capture_sizes": [-4]}, r"compilation_config\.cudagraph_capture_sizes entries must be positive integers \(>= 1\), got -4"),
        ({"cuda_graph_sizes": [-1]}, r"compilation_config\.cuda_graph_sizes entries must be positive integers"),
        ({"cuda_graph_sizes": []}, r"compilation_config\.cuda_graph_sizes must hold at least one size"),
        ({"compile_sizes": ["all"]}, r'compilation_config\.compile_sizes entries must be positive integers \(>= 1\) or the string "cudagraph_capture_sizes", got \'all\''),
        ({"splitting_ops": ["attention"]}, r'compilation_config\.splitting_ops must be a list of "namespace\.op" names'),
        ({"inductor_compile_config": "max_autotune"}, r"compilation_config\.inductor_compile_config must be a dict"),
    ],
)
def test_invalid_compilation_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CompilationConfig(**kwargs)


def test_capture_size_above_max_num_seqs_is_refused() -> None:
    with pytest.raises(ValueError, match=r"compilation_config\.cudagraph_capture_sizes entries must be between 1 and max_num_seqs=8, got \[16\]"):
        Config(max_num_seqs=8, compilation_config=CompilationConfig(level=3, cudagraph_capture_sizes=[4, 16]))
    with pytest.raises(ValueError, match=r"compilation_config\.cuda_graph_sizes entries must be between 1 and max_num_seqs=8, got \[32\]"):
        Config(max_num_seqs=8, compilation_config=CompilationConfig(level=3, cuda_graph_sizes=[4, 32]))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs must be a positive integer, got 0"),
        ({"dtype": "int8"}, "dtype must be one of bfloat16, float16, float32, auto, got 'int8'"),
        ({"role": "both"}, "role must be one of unified, prefill, decode, got 'both'"),
        ({"load_format": "gguf"}, "load_format must be one of auto, safetensors, dummy, got 'gguf'"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        ({"block_size": -16}, "block_size must be a positive integer, got -16"),
    ],
)
def test_invalid_serving_values_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config(**kwargs)


def test_finalize_model_len_defaults() -> None:
    cfg = Config()
    cfg.finalize_model_len(131072)
    assert cfg.max_model_len == 4096 and cfg.max_num_batched_tokens == 4096
    short = Config(max_model_len=512)
    short.finalize_model_len(131072)
    assert short.max_model_len == 512 and short.max_num_batched_tokens == 2048


def test_max_model_len_above_the_models_positions_is_refused() -> None:
    cfg = Config(max_model_len=4096)
    with pytest.raises(ValueError, match="max_model_len=4096 is above .* max_position_embeddings=2048"):
        cfg.finalize_model_len(2048)
    Config(max_model_len=2048).finalize_model_len(2048)  # the bound itself is allowed
