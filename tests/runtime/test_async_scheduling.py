"""Asynchronous scheduling (LLMEngine.step launches a step before reading the last): the same
outputs as synchronous steps, with the tokens really left on the device between steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from tiny import tiny_engine

from atom.config import CompilationConfig
from atom.engine import LLMEngine, SamplingParams
from atom.engine.batch import StepBatch
from atom.engine.sequence import PENDING_TOKEN, Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1] + [(5 * i + 11 * j) % 240 + 3 for j in range(9 + 7 * i)] for i in range(5)]


def _engine(async_scheduling: bool, **overrides) -> LLMEngine:
    base = dict(max_model_len=96, max_num_seqs=4, seed=3, async_scheduling=async_scheduling)
    return tiny_engine(**{**base, **overrides})


@dataclass
class Stream:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: list[int] = field(default_factory=list)


# A request: (id, prompt, params, the step at which it is added)
Request = tuple[str, list[int], SamplingParams, int]


def _run(engine: LLMEngine, requests: list[Request],
         on_step: Callable[[LLMEngine, int], None] | None = None) -> dict[str, Stream]:
    """Step until every request has finished; each request's outputs, as a client sees them."""
    streams = {rid: Stream() for rid, *_ in requests}
    step = 0
    while step == 0 or engine.has_unfinished_requests() or any(at >= step for *_, at in requests):
        for rid, prompt, params, at in requests:
            if at == step:
                engine.add_request(rid, prompt, params)
        for out in engine.step():
            s = streams[out.request_id]
            s.tokens += out.new_token_ids
            s.logprobs += out.new_logprobs or []
            s.num_output_tokens.append(out.num_output_tokens)
            if out.finished:
                assert s.finish_reason is None, f"{out.request_id} finished twice"
                s.finish_reason = out.finish_reason
        if on_step is not None:
            on_step(engine, step)
        step += 1
        assert step < 500, "the engine did not finish"
    assert engine.block_manager.num_used_blocks == 0
    return streams


def _same(a: dict[str, Stream], b: dict[str, Stream]) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].tokens == b[rid].tokens, rid
        assert a[rid].finish_reason == b[rid].finish_reason, rid
        assert a[rid].num_output_tokens[-1] == b[rid].num_output_tokens[-1], rid
        assert a[rid].logprobs == pytest.approx(b[rid].logprobs, abs=1e-5), rid


def _mixed_requests(engine: LLMEngine) -> list[Request]:
    """Lengths that end at different steps (a gap in the batch: pending rows out of order),
    late arrivals (prefill mixed with decode), logprobs and a seeded sampled request."""
    reqs: list[Request] = [
        ("long", PROMPTS[0], GREEDY, 0),
        ("one", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=1), 0),
        ("three", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=3, logprobs=True), 0),
        ("late", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), 4),
        ("seeded", PROMPTS[4], SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=7,
                                              ignore_eos=True, logprobs=True), 2),
    ]
    stop = engine.generate([PROMPTS[0]], GREEDY)[0][3]  # the fourth greedy token of "long"
    reqs.append(("stops", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                     stop_token_ids=[stop]), 1))
    return reqs


def _sync_then_async(engine: LLMEngine) -> tuple[dict[str, Stream], dict[str, Stream]]:
    reqs = _mixed_requests(engine)
    engine.async_scheduling = False
    sync = _run(engine, reqs)
    engine.async_scheduling = True
    overlapped = _run(engine, reqs)
    _same(overlapped, sync)
    return sync, overlapped


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_async_steps_give_the_outputs_of_synchronous_steps() -> None:
    engine = _engine(True)
    # per step with pending rows: does each row take the token sampled for the same row?
    orders: list[bool] = []
    build = engine.runner._build

    def recording_build(rows_ids, *args, **kwargs):
        # a pending row is staged as the placeholder -(j + 1): last step's j-th sampled token
        pending = [(row, -v - 1) for row, v in enumerate(rows_ids) if v < 0]
        if pending:
            orders.append(all(row == src for row, src in pending))
        return build(rows_ids, *args, **kwargs)

    engine.runner._build = recording_build
    sync, overlapped = _sync_then_async(engine)
    assert True in orders and False in orders  # rows kept and changed their places
    assert sync["stops"].finish_reason == "stop" and len(sync["stops"].tokens) == 4
    assert sync["long"].finish_reason == "length" and len(sync["long"].tokens) == 12
    assert sync["one"].tokens and len(sync["three"].logprobs) == 3
    # Each output counts the tokens up to its own, not the one still on the device.
    assert overlapped["long"].num_output_tokens == list(range(1, 13))


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_tokens_stay_on_the_device_between_steps() -> None:
    """After a decode step returns, its sequences hold PENDING_TOKEN: the next step read the
    real ids on the device, yet the outputs match synchronous steps."""
    seen: list[int] = []

    def pending(engine: LLMEngine, step: int) -> None:
        running: list[Sequence] = engine.scheduler.running
        seen.append(sum(s.token_ids[-1] == PENDING_TOKEN for s in running))
        if engine._launched is not None:
            for seq, slot in zip(engine._launched.seqs, engine._launched.slots, strict=True):
                if slot is not None and not seq.is_finished:
                    assert seq.token_ids[slot] == PENDING_TOKEN

    reqs: list[Request] = [(f"r{i}", PROMPTS[i], GREEDY, 0) for i in range(3)]
    overlapped = _run(_engine(True), reqs, pending)
    _same(overlapped, _run(_engine(False), reqs))
    assert max(seen) == 3  # every running sequence waited on the device at once


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_preemption_with_pending_tokens_keeps_output() -> None:
    reqs: list[Request] = [(f"r{i}", PROMPTS[i], GREEDY, 0) for i in range(4)]
    expected = _run(_engine(False, num_kv_blocks=64), reqs)
    tight = _engine(True, num_kv_blocks=6)  # 96 tokens for four growing sequences
    got = _run(tight, reqs)
    assert tight.scheduler.num_preemptions > 0
    _same(got, expected)


def test_abort_while_a_step_is_in_flight() -> None:
    expected = _engine(False).generate([PROMPTS[2]], GREEDY)[0]
    engine = _engine(True)
    engine.add_request("a", PROMPTS[1], GREEDY)
    engine.add_request("b", PROMPTS[2], GREEDY)
    got: dict[str, list] = {"a": [], "b": []}
    for _ in range(3):
        for o in engine.step():
            got[o.request_id].append(o)
    assert engine._launched is not None
    a = next(s for s in engine._launched.seqs if s.request_id == "a")
    before = len(got["a"])
    assert before == 2  # the prefill's token and the first decode's; the second is in flight
    engine.abort_request("a")
    assert PENDING_TOKEN not in a.token_ids
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id].append(o)
    after = got["a"][before:]  # the step in flight is dropped: one output, no tokens
    assert [(o.finished, o.finish_reason, o.new_token_ids) for o in after] == [(True, "abort", [])]
    assert [t for o in got["b"] for t in o.new_token_ids] == expected
    assert engine.block_manager.num_used_blocks == 0


def test_a_pending_row_without_tokens_is_refused() -> None:
    engine = _engine(True)
    seq = Sequence("x", [5, 6, PENDING_TOKEN], GREEDY)
    seq.pending_src = 1
    seq.block_table = [0]
    seq.num_computed_tokens, seq.num_scheduled_tokens = 2, 1
    with pytest.raises(ValueError, match="wait for sampled tokens"):
        engine.runner.prepare_inputs(StepBatch.of([seq], False))
    ids, *_ = engine.runner.prepare_inputs(StepBatch.of([seq], False),
                                          pending_tokens=torch.tensor([41, 42]))
    assert ids.tolist() == [42]
    # a placeholder without a named source is refused, not taken for sampled row 0
    seq.pending_src = None
    with pytest.raises(ValueError, match="still on the device"):
        engine.runner.prepare_inputs(StepBatch.of([seq], False),
                                          pending_tokens=torch.tensor([41, 42]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs, pinned copies)")
@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("mode", ["FULL", "TR_HYBRID"])
def test_async_steps_on_cuda_graphs(level: int, mode: str) -> None:
    """On CUDA the copies and the pending rows' device copy run on the stream between graph
    replays: the same outputs, and the graphs did replay."""
    from atom.utils.counters import counters

    cc = CompilationConfig(level=level, cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8])
    engine = _engine(True, device="cuda", max_num_seqs=8, gpu_memory_utilization=0.3,
                     compilation_config=cc)
    with counters.track() as run:
        _sync_then_async(engine)
    assert run.get("graph_replays", 0) > 0
    del engine
    torch.cuda.empty_cache()


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_an_idle_engine_reads_a_new_prompts_token_at_once() -> None:
    """New prompts on an idle engine: their first tokens come from the step that computed
    them (not one step later, after the next step's preparation); the steps after overlap
    again, and the tokens are those of synchronous steps."""
    expected = _engine(False).generate([PROMPTS[0], PROMPTS[1]], GREEDY)
    engine = _engine(True)
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], GREEDY)
    first = engine.step()
    assert [(o.request_id, len(o.new_token_ids)) for o in first] == [("a", 1), ("b", 1)]
    assert engine._launched is None
    second = engine.step()
    assert second == [] and engine._launched is not None  # the decode step is in flight
    got = {"a": first[0].new_token_ids, "b": first[1].new_token_ids}
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] = got[o.request_id] + o.new_token_ids
    assert [got["a"], got["b"]] == expected
    # idle again: at once; a prompt that joins a running sequence overlaps as before
    engine.add_request("c", PROMPTS[2], GREEDY)
    assert [o.request_id for o in engine.step()] == ["c"]
    assert engine.step() == []
    engine.add_request("d", PROMPTS[3], GREEDY)
    assert [o.request_id for o in engine.step()] == ["c"]  # d's token is in flight
    assert sorted(o.request_id for o in engine.step()) == ["c", "d"]
