"""Compilation levels 0-3 in one process: results, what gets compiled, and dispatch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from test_compile_support import (
    SPLIT_OP,
    ClosedFormModel,
    build_random,
    make_config,
    random_inputs,
    share_inductor_cache_for_tests,
    speed_up_cpu_inductor,
    split_calls,
)
from torch import nn

from atom.compilation.backends import BufferMutationError, split_graph
from atom.compilation.decorators import compile_for_level, support_torch_compile
from atom.config import CompilationConfig, Config
from atom.utils.counters import counters

speed_up_cpu_inductor()
share_inductor_cache_for_tests()

SIZES = [3, 8, 5, 2, 1, 13]


def _eager_reference(num_layers: int = 2) -> nn.Module:
    return build_random(0, num_layers=num_layers)


def _assert_matches_eager(model: nn.Module, num_layers: int = 2) -> None:
    eager = _eager_reference(num_layers)
    for bs in SIZES:
        ids, pos = random_inputs(bs)
        torch.testing.assert_close(model(ids, pos), eager(ids, pos), rtol=1e-4, atol=1e-4)


@pytest.fixture
def cache_dir(tmp_path: Path) -> str:
    return str(tmp_path / "cache")


def test_level0_runs_eagerly(cache_dir: str) -> None:
    model = build_random(0, cache_dir)
    with counters.track() as delta:
        _assert_matches_eager(model)
    assert delta == {}
    assert model.do_not_compile


def test_level1_runs_dynamo_with_the_eager_backend_only(cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch._inductor.compile_fx as compile_fx_mod

    inductor_calls = []
    real = compile_fx_mod.compile_fx
    monkeypatch.setattr(
        compile_fx_mod, "compile_fx", lambda *a, **k: inductor_calls.append(1) or real(*a, **k)
    )
    model = build_random(1, cache_dir)
    assert model.do_not_compile  # the decorator leaves level 1 to the runner
    compile_for_level(model, model.atom_config)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with counters.track() as delta:
        _assert_matches_eager(model)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs_before  # Dynamo ran
    assert inductor_calls == []
    assert "pieces_compiled" not in delta and "graphs_compiled" not in delta


def test_level1_fullgraph_refuses_a_graph_break(cache_dir: str) -> None:
    @support_torch_compile
    class Breaks(nn.Module):
        def __init__(self, *, atom_config: Config) -> None:
            super().__init__()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            torch._dynamo.graph_break()
            return x + 1

    model = compile_for_level(Breaks(atom_config=make_config(1, cache_dir)), make_config(1, cache_dir))
    with pytest.raises(Exception, match="graph_break|Graph break|graph break"):
        model(torch.ones(3, 2))


@pytest.mark.slow  # 80 s of Inductor; the level-3 tests keep Inductor in the fast tier
def test_level2_compiles_once_for_all_batch_sizes(cache_dir: str) -> None:
    model = build_random(2, cache_dir)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with counters.track() as delta:
        _assert_matches_eager(model)
    # One Dynamo graph, one piece (no splitting at level 2), compiled once.
    assert delta["graphs_compiled"] == 1
    assert delta["pieces"] == 1
    assert delta["pieces_compiled"] == 1
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before == 1
    assert len(model.compiled_codes) == 1


@pytest.mark.slow  # 35 s of Inductor; the level-3 tests keep Inductor in the fast tier
def test_level2_later_calls_skip_dynamo(cache_dir: str) -> None:
    model = build_random(2, cache_dir)
    ids, pos = random_inputs(4)
    model(ids, pos)
    calls = []
    inner = model.compiled_callable
    model.compiled_callable = lambda *a, **k: calls.append(1) or inner(*a, **k)
    eager = _eager_reference()
    for bs in (7, 33, 2):
        ids, pos = random_inputs(bs)
        torch.testing.assert_close(model(ids, pos), eager(ids, pos), rtol=1e-4, atol=1e-4)
    assert calls == []  # guard-free dispatch to the captured bytecode


def test_first_call_with_batch_one_waits_for_a_batch_of_two(cache_dir: str) -> None:
    model = build_random(2, cache_dir, num_layers=1)
    with counters.track() as delta:
        ids, pos = random_inputs(1)
        model(ids, pos)
    assert "graphs_compiled" not in delta and model.compiled_codes == []
    with counters.track() as delta:
        _assert_matches_eager(model, num_layers=1)
    assert delta["graphs_compiled"] == 1


@pytest.mark.parametrize("num_layers", [1, 3])
def test_level3_closed_form_pieces(cache_dir: str, num_layers: int) -> None:
    model = ClosedFormModel(atom_config=make_config(3, cache_dir), num_layers=num_layers)
    with counters.track() as delta:
        for bs in SIZES:
            x = torch.randn(bs, 4)
            before = split_calls["n"]
            torch.testing.assert_close(model(x), x * 6**num_layers, rtol=1e-5, atol=1e-2)
            if bs != SIZES[0]:  # compiled calls run the split op once per layer
                assert split_calls["n"] - before == num_layers
    assert delta["graphs_compiled"] == 1
    assert delta["pieces"] == 2 * num_layers + 1
    assert delta["pieces_compiled"] == num_layers + 1
    assert delta["artifacts_saved"] == num_layers + 1
    backend = model.backend
    assert [item.is_splitting_graph for item in backend.piecewise_graphs] == [i % 2 == 1 for i in range(2 * num_layers + 1)]
    assert os.path.isfile(os.path.join(model.atom_config.compilation_config.local_cache_dir, "computation_graph.py"))


def test_level3_random_model_matches_eager(cache_dir: str) -> None:
    model = build_random(3, cache_dir)
    with counters.track() as delta:
        _assert_matches_eager(model)
    assert delta["pieces"] == 5 and delta["pieces_compiled"] == 3


def test_level3_without_inductor_splits_but_saves_nothing(cache_dir: str) -> None:
    model = build_random(3, cache_dir, use_inductor=False)
    with counters.track() as delta:
        _assert_matches_eager(model)
    assert delta["pieces"] == 5
    assert "artifacts_saved" not in delta


def test_compile_sizes_are_compiled_lazily_once(cache_dir: str) -> None:
    model = ClosedFormModel(atom_config=make_config(3, cache_dir, compile_sizes=[4]), num_layers=1)
    x = torch.randn(6, 4)
    with counters.track() as first:
        model(x)
    assert first["pieces_compiled"] == 2  # general shape only
    for bs, new_compiles in ((4, 2), (4, 0), (5, 0)):
        x = torch.randn(bs, 4)
        with counters.track() as delta:
            torch.testing.assert_close(model(x), x * 6, rtol=1e-5, atol=1e-2)
        assert delta.get("pieces_compiled", 0) == new_compiles, bs
    entries = [p for p in model.backend.split_gm.__dict__.values() if hasattr(p, "concrete_size_entries")]
    assert len(entries) == 2 and all(e.concrete_size_entries[4].compiled for e in entries)


def test_split_graph_matches_op_names() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        torch.ops.aiter.toy_affine(x + 1, out)
        return out * 2

    gm = torch.fx.symbolic_trace(f)
    split_gm, items = split_graph(gm, [SPLIT_OP])
    assert [(i.submod_name, i.is_splitting_graph) for i in items] == [
        ("submod_0", False), ("submod_1", True), ("submod_2", False)
    ]
    x = torch.randn(3)
    torch.testing.assert_close(split_gm(x), (3 * (x + 1) + 19) * 2)
    _, unsplit = split_graph(gm, ["aiter.other_op"])
    assert len(unsplit) == 1


def test_cudagraph_copy_inputs_reuses_static_buffers(cache_dir: str) -> None:
    model = ClosedFormModel(
        atom_config=make_config(3, cache_dir, cudagraph_copy_inputs=True, cudagraph_mode="FULL", cudagraph_capture_sizes=[8]),
        num_layers=1,
    )
    addresses = set()
    for bs in (8, 3, 5):
        x = torch.randn(bs, 4)
        torch.testing.assert_close(model(x), x * 6, rtol=1e-5, atol=1e-2)
        addresses.update(buf.data_ptr() for buf in model.backend._input_buffers.values())
    assert len(model.backend._input_buffers) == 1 and len(addresses) == 1


def test_debug_dump_path_per_rank(tmp_path: Path) -> None:
    dump = tmp_path / "dbg"
    model = ClosedFormModel(atom_config=make_config(3, str(tmp_path / "c"), debug_dump_path=str(dump)), num_layers=1)
    model(torch.randn(3, 4))
    files = sorted(os.listdir(dump / "rank_0"))
    assert "ClosedFormModel_computation_graph.py" in files
    assert "ClosedFormModel_dynamo_graph.py" in files
    assert "transformed_code.txt" in files


class _InplaceBuffer(nn.Module):
    def __init__(self, *, atom_config: Config) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return x + self.steps


class _ReassignBuffer(nn.Module):
    def __init__(self, *, atom_config: Config) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps = self.steps + 1
        return x + self.steps


@pytest.mark.parametrize("cls", [_InplaceBuffer, _ReassignBuffer])
@pytest.mark.parametrize("level", [2, 3])
def test_forward_modifying_a_buffer_is_refused(cache_dir: str, cls: type, level: int) -> None:
    model = support_torch_compile(type(cls.__name__ + str(level), (cls,), {}))(
        atom_config=make_config(level, cache_dir, use_inductor=False)
    )
    with pytest.raises(BufferMutationError, match="buffer"):
        model(torch.ones(4, 2))


def test_buffer_read_only_is_fine(cache_dir: str) -> None:
    @support_torch_compile
    class ReadsBuffer(nn.Module):
        def __init__(self, *, atom_config: Config) -> None:
            super().__init__()
            self.register_buffer("scale", torch.full((2,), 3.0))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale

    model = ReadsBuffer(atom_config=make_config(3, cache_dir, use_inductor=False))
    x = torch.randn(5, 2)
    torch.testing.assert_close(model(x), x * 3)
    torch.testing.assert_close(model(x[:2]), x[:2] * 3)


def test_enforce_eager_leaves_model_uncompiled(cache_dir: str) -> None:
    cfg = Config(
        model="toy", dtype="float32", enforce_eager=True, max_num_seqs=64,
        compilation_config=CompilationConfig(level=3, cache_dir=cache_dir, splitting_ops=[SPLIT_OP]),
    )
    model = ClosedFormModel(atom_config=cfg, num_layers=1)
    with counters.track() as delta:
        x = torch.randn(4, 4)
        torch.testing.assert_close(model(x), x * 6, rtol=1e-5, atol=1e-2)
    assert delta == {} and model.do_not_compile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels through Inductor)")
def test_level3_on_cuda_matches_eager(cache_dir: str) -> None:
    model = ClosedFormModel(atom_config=make_config(3, cache_dir, compile_sizes=[8]), num_layers=2)
    with counters.track() as delta:
        for bs in (5, 8, 8, 3, 1):
            x = torch.randn(bs, 64, device="cuda")
            torch.testing.assert_close(model(x), x * 36, rtol=1e-4, atol=1e-2)
    assert delta["pieces"] == 5 and delta["pieces_compiled"] == 6  # 3 general + 3 for size 8


def test_make_compiler_picks_the_adaptor() -> None:
    # The guide's import paths are checked once, in test_architecture.py.
    from atom.compilation.compiler_interface import make_compiler

    assert type(make_compiler(True)).__name__ == "InductorStandaloneAdaptor"  # torch >= 2.8
    assert type(make_compiler(False)).__name__ == "EagerAdaptor"


def test_counter_registry() -> None:
    from atom.utils.counters import CounterRegistry

    reg = CounterRegistry()
    reg.inc("pieces")
    reg.inc("pieces", 4)
    assert reg.get("pieces") == 5 and reg["pieces"] == 5 and reg.get("unknown") == 0
    with reg.track() as delta:
        reg.inc("cache_hits", 2)
    assert delta == {"cache_hits": 2}
    assert reg.snapshot() == {"pieces": 5, "cache_hits": 2}
    reg.reset()
    assert reg.snapshot() == {}
