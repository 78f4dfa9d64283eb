"""LLMEngine on a tiny dummy model: request lifecycle, stops, limits, batching invariance."""

from __future__ import annotations

import pytest
from tiny import tiny_engine

from atom.engine import LLMEngine, SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    e = tiny_engine(warmup=False, max_model_len=64, num_kv_blocks=64, max_num_seqs=4, seed=7)
    summary = e.warmup()
    assert summary["level"] == 0 and summary["captured_sizes"] == [] and e.warmed_up
    return e


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
P1, P2, P3 = [1, 5, 9, 200, 31], [1] + list(range(40, 70)), [3]


def test_batching_does_not_change_greedy_output(engine: LLMEngine) -> None:
    alone = [engine.generate([p], GREEDY)[0] for p in (P1, P2, P3)]
    together = engine.generate([P1, P2, P3], GREEDY)
    assert together == alone
    assert all(len(t) == 10 for t in together)
    assert len({tuple(t) for t in together}) == 3


def test_outputs_stream_one_token_per_step(engine: LLMEngine) -> None:
    engine.add_request("s", P1, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                               logprobs=True))
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(o for o in engine.step() if o.request_id == "s")
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1, 1]
    assert [o.finished for o in outs] == [False, False, False, True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 4
    assert outs[-1].num_prompt_tokens == len(P1)
    assert all(len(o.new_logprobs) == 1 and o.new_logprobs[0] <= 0 for o in outs)


def test_stop_token_ids_end_with_stop(engine: LLMEngine) -> None:
    full = engine.generate([P2], GREEDY)[0]
    stop_at = full[3]
    first = full.index(stop_at)
    got = engine.generate([P2], SamplingParams(temperature=0.0, max_tokens=10,
                                               stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert got == full[: first + 1]
    engine.add_request("st", P2, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_at]))
    last = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            last = o
    assert last.finish_reason == "stop"


def test_eos_stops_unless_ignored(engine: LLMEngine) -> None:
    full = engine.generate([P1], GREEDY)[0]
    engine.eos_token_ids = {full[2]}
    try:
        assert engine.generate([P1], SamplingParams(temperature=0.0, max_tokens=10))[0] == full[:full.index(full[2]) + 1]
        assert engine.generate([P1], GREEDY)[0] == full
    finally:
        engine.eos_token_ids = set(engine.hf_config.eos_token_id)


def test_max_model_len_limits(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add_request("long", list(range(3, 68)), GREEDY)
    # a prompt that fits stops with "length" at max_model_len
    out = engine.generate([list(range(3, 63))], SamplingParams(temperature=0.0, max_tokens=50,
                                                               ignore_eos=True))[0]
    assert len(out) == 4


def test_bad_requests(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("v", [1, 999999], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("m", [1], SamplingParams(max_tokens=-1))
    engine.add_request("dup", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [1, 2], GREEDY)
    engine.abort_request("dup")
    engine.step()


def test_abort_frees_blocks_and_reports(engine: LLMEngine) -> None:
    engine.add_request("a", P2, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.stats()["kv_blocks_used"] > 0 and engine.stats()["running"] == 1
    engine.abort_request("a")
    assert engine.stats()["kv_blocks_used"] == 0
    outs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [("a", True, "abort")]
    assert not engine.has_unfinished_requests()
    engine.abort_request("unknown")  # no error


def test_seeded_sampling_is_reproducible(engine: LLMEngine) -> None:
    p = SamplingParams(temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    a = engine.generate([P1], p)[0]
    b = engine.generate([P1, P2, P3], [p, SamplingParams(temperature=1.0, max_tokens=8), GREEDY])[0]
    assert a == b


def test_stats_fields(engine: LLMEngine) -> None:
    s = engine.stats()
    for key in ("running", "waiting", "kv_blocks_used", "kv_blocks_total"):
        assert key in s
    assert s["kv_blocks_total"] == 64


@pytest.mark.parametrize("level", [0, pytest.param(3, marks=pytest.mark.slow)])  # 3: 25 s
def test_one_sequence_engine_warms_up_and_generates(level: int) -> None:
    """max_num_seqs=1: the warm-up's dummy batches fit the runner's one-sequence buffers."""
    from atom.config import CompilationConfig

    e = tiny_engine(warmup=False, max_model_len=64, num_kv_blocks=16, max_num_seqs=1, seed=7,
                    compilation_config=CompilationConfig(level=level))
    assert e.warmup()["level"] == level
    one, two = e.generate([P1, P2], GREEDY)  # the second waits for the first's slot
    assert len(one) == len(two) == GREEDY.max_tokens


def test_the_engine_stops_at_every_eos_its_checkpoint_names(tmp_path) -> None:
    """config.json, generation_config.json and tokenizer_config's eos_token: the one EOS rule
    (the server adds none of its own)."""
    import json

    from atom.engine.eos import model_eos_ids
    from atom.models.model_config import ModelConfig

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 2]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eot|>", "added_tokens_decoder": {"7": {"content": "<|eot|>"}},
    }))
    cfg = ModelConfig(vocab_size=256, eos_token_id=[2], path=str(tmp_path))
    assert model_eos_ids(cfg) == {2, 7, 9}
    assert model_eos_ids(ModelConfig(vocab_size=256, eos_token_id=[2])) == {2}
