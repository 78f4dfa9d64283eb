"""The level-3 graph mode by model size (atom.cudagraph.mode_defaults): the table's lookup, and
the model runner applying it only when no mode was configured."""

from __future__ import annotations

import pytest

from atom.config import CompilationConfig, Config, CUDAGraphMode
from atom.cudagraph import mode_defaults
from atom.cudagraph.mode_defaults import SizeDefault, default_mode

M = CUDAGraphMode
TABLE = (SizeDefault(8_000_000_000, M.TR_HYBRID, "test"), SizeDefault(2_000_000_000, M.FULL, "test"))


def test_smallest_row_holding_the_size_wins() -> None:
    assert default_mode(1_200_000_000, TABLE) == M.FULL
    assert default_mode(2_000_000_000, TABLE) == M.FULL
    assert default_mode(7_000_000_000, TABLE) == M.TR_HYBRID
    assert default_mode(70_000_000_000, TABLE) == M.TR_HYBRID  # above every row: the fallback
    assert default_mode(10, ()) == M.TR_HYBRID
    assert default_mode(10) == M.TR_HYBRID if not mode_defaults.MODE_BY_SIZE else True


def test_only_a_defaulted_level3_mode_is_marked() -> None:
    assert Config(model="tiny-llama", device="cpu",
                  compilation_config=CompilationConfig(level=3)).graph_mode_by_size
    for cc in (CompilationConfig(level=3, cudagraph_mode="FULL"), CompilationConfig(level=0),
               CompilationConfig(level=3, use_cudagraph=False)):
        assert not Config(model="tiny-llama", device="cpu", compilation_config=cc).graph_mode_by_size
    assert "graph_mode_by_size" not in Config(model="tiny-llama", device="cpu").to_dict()


@pytest.mark.parametrize("configured", [None, "TR_HYBRID"])
def test_runner_applies_the_table_when_no_mode_is_set(monkeypatch: pytest.MonkeyPatch,
                                                      configured: str | None) -> None:
    from atom.engine.model_runner import ModelRunner

    monkeypatch.setattr(mode_defaults, "MODE_BY_SIZE", (SizeDefault(10**9, M.FULL, "test"),))
    cfg = Config(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu",
                 max_model_len=128, num_kv_blocks=16,
                 compilation_config=CompilationConfig(level=3, cudagraph_mode=configured))
    ModelRunner(cfg)
    want = M.FULL if configured is None else M.TR_HYBRID
    assert cfg.compilation_config.cudagraph_mode == want
