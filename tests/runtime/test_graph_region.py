"""Breakable recording (TokenGraph), request graphs and eager regions, on the CPU.

A fake recorder logs segment boundaries to check the sequencing; CpuOpRecorder replays the
recorded aten ops, so replays can be checked against eager arithmetic with changed inputs and
live forward-context metadata.
"""

from __future__ import annotations

import pytest
import torch
from cpu_recorder import CpuOpRecorder
from torch import nn
from torch.library import Library

from atom.compilation.custom_ops import direct_register_custom_op
from atom.config import CUDAGraphMode
from atom.cudagraph import region_graph as rg
from atom.cudagraph.pool import GraphPool
from atom.cudagraph.runner import ForwardMode
from atom.utils.counters import counters
from atom.utils.forward_context import (
    AttentionMetaData,
    Context,
    StepKind,
    StepPlan,
    forward_context,
    get_forward_context,
)


class FakeRecorder:
    """Logs begin/end; a segment's replay logs its index."""

    def __init__(self, log: list[str], capturing: bool = False) -> None:
        self.log = log
        self.n = 0
        self.capturing = capturing
        self.exited = False

    def enter(self) -> None:
        self.log.append("enter")

    def begin(self) -> None:
        self.log.append(f"begin{self.n}")

    def end(self) -> rg.Segment:
        i = self.n
        self.n += 1
        self.log.append(f"end{i}")
        log = self.log

        class Seg:
            def replay(self) -> None:
                log.append(f"seg{i}")

        return Seg()

    def exit(self) -> None:
        self.exited = True
        self.log.append("exit")

    def is_capturing(self) -> bool:
        return self.capturing


def _region_log(log: list[str]):
    @rg.eager_region
    def region(out: torch.Tensor, i: int) -> None:
        ctx = get_forward_context().context
        live = ctx.batch_size if ctx is not None else -1
        log.append(f"r{i}@{live}")
        out.fill_(live)

    return region


def test_segments_and_regions_alternate_and_regions_read_live_context() -> None:
    log: list[str] = []
    region = _region_log(log)
    buf = torch.zeros(2)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            region(buf, i)
        return x

    with forward_context(context=Context(batch_size=5)):
        rec = rg.record(fwd, (torch.zeros(4),), breakable=True, recorder=FakeRecorder(log))
    assert log == ["enter", "begin0", "end0", "r0@5", "begin1", "end1", "r1@5", "begin2",
                   "end2", "r2@5", "begin3", "end3", "exit"]
    assert len(rec.segments) == 4 and len(rec.regions) == 3
    assert rec.num_tokens == 4
    assert not rg.is_recording()

    log.clear()
    before = counters.get("eager_region_runs")
    with forward_context(context=Context(batch_size=9)):
        rec.replay((torch.zeros(4),))
    assert log == ["seg0", "r0@9", "seg1", "r1@9", "seg2", "r2@9", "seg3"]
    assert counters.get("eager_region_runs") - before == 3
    assert buf.tolist() == [9.0, 9.0]  # the region wrote into the caller's buffer


def test_breaks_at_start_and_end_give_empty_edge_segments() -> None:
    log: list[str] = []
    region = _region_log(log)
    buf = torch.zeros(1)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        region(buf, 0)
        y = x + 1
        region(buf, 1)
        return y

    rec = rg.record(fwd, (torch.zeros(2),), breakable=True, recorder=FakeRecorder(log))
    assert len(rec.segments) == 3 and len(rec.regions) == 2


def test_non_breakable_recording_captures_regions_inline() -> None:
    log: list[str] = []
    region = _region_log(log)
    buf = torch.zeros(1)

    def fwd(x: torch.Tensor) -> torch.Tensor:
        region(buf, 0)
        region(buf, 1)
        return x

    rec = rg.record(fwd, (torch.zeros(2),), breakable=False, recorder=FakeRecorder(log))
    assert len(rec.segments) == 1 and rec.regions == []
    assert log == ["enter", "begin0", "r0@-1", "r1@-1", "end0", "exit"]


def test_nested_recording_is_refused() -> None:
    log: list[str] = []

    def inner(x: torch.Tensor) -> torch.Tensor:
        return rg.record(lambda y: y, (x,), breakable=True, recorder=FakeRecorder(log)).output

    rec_outer = FakeRecorder(log)
    with pytest.raises(RuntimeError, match="nested"):
        rg.record(inner, (torch.zeros(1),), breakable=True, recorder=rec_outer)
    assert rec_outer.exited and not rg.is_recording()
    # A stream already capturing (someone else's graph) is refused too.
    with pytest.raises(RuntimeError, match="nested"):
        rg.record(lambda y: y, (torch.zeros(1),), breakable=True,
                  recorder=FakeRecorder(log, capturing=True))


def test_region_returning_a_fresh_tensor_is_refused() -> None:
    @rg.eager_region
    def bad(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    rec = FakeRecorder([])
    with pytest.raises(RuntimeError, match="caller-provided output buffer"):
        rg.record(lambda x: bad(x), (torch.zeros(1),), breakable=True, recorder=rec)
    assert rec.exited and not rg.is_recording()
    assert bad(torch.ones(1)).item() == 2.0  # outside a recording it is the plain function


# ----------------------------------------------------------------- a registered eager op

_lib = Library("atomgraphtest", "FRAGMENT")
_op_calls = {"n": 0}


@rg.eager_region
def _shift_by_live_rows(h: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    """out = h + slot_mapping (per row, from the live metadata) + layer_id."""
    _op_calls["n"] += 1
    md = get_forward_context().attn_metadata
    out.copy_(h + md.slot_mapping.to(h.dtype)[:, None] + layer_id)


def _shift_fake(h: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    return None


direct_register_custom_op("shift", _shift_by_live_rows, mutates_args=["out"],
                          fake_impl=_shift_fake, target_lib=_lib, dispatch_key="CPU")


class ToyStack(nn.Module):
    """L layers of x -> 2x + shift(x) through the dispatcher, then 3x + 19 (closed form)."""

    def __init__(self, layers: int = 3) -> None:
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.layers):
            h = x * 2
            out = torch.empty_like(h)
            torch.ops.atomgraphtest.shift(h, out, i)
            x = out
        return x * 3 + 19


def _expected(x: torch.Tensor, slots: torch.Tensor, layers: int) -> torch.Tensor:
    for i in range(layers):
        x = x * 2 + slots[:, None] + i
    return x * 3 + 19


def test_op_recording_replays_with_changed_inputs_and_live_metadata() -> None:
    torch.manual_seed(0)
    model = ToyStack(layers=3)
    x = torch.randn(4, 3)
    slots = torch.arange(4, dtype=torch.int64)
    static_out = torch.zeros(8, 3)
    with forward_context(attn_metadata=AttentionMetaData(slot_mapping=slots)):
        rec = rg.record(model, (x,), breakable=True, recorder=CpuOpRecorder(),
                        static_output=static_out)
    assert len(rec.segments) == 4 and len(rec.regions) == 3
    assert rec.output.data_ptr() == static_out.data_ptr()  # held in the static buffer

    for draw in range(3):
        new_x = torch.randn(4, 3)
        live_slots = torch.randint(-1, 50, (4,))  # another step's metadata, other tensor
        _op_calls["n"] = 0
        with forward_context(attn_metadata=AttentionMetaData(slot_mapping=live_slots)):
            got = rec.replay((new_x,))
        assert _op_calls["n"] == 3, draw  # once per layer per replay
        torch.testing.assert_close(got, _expected(new_x, live_slots.float(), 3))
        torch.testing.assert_close(static_out[:4], got)


def test_two_recordings_interleave_correctly() -> None:
    model = ToyStack(layers=2)
    recs = {}
    for n in (4, 2):
        slots = torch.zeros(n, dtype=torch.int64)
        with forward_context(attn_metadata=AttentionMetaData(slot_mapping=slots)):
            recs[n] = rg.record(model, (torch.zeros(n, 3),), breakable=True,
                                recorder=CpuOpRecorder())
    for step in range(4):
        n = (4, 2)[step % 2]
        x = torch.randn(n, 3)
        slots = torch.randint(0, 9, (n,))
        with forward_context(attn_metadata=AttentionMetaData(slot_mapping=slots)):
            got = recs[n].replay((x,))
        torch.testing.assert_close(got, _expected(x, slots.float(), 2))


# ----------------------------------------------------------------- TokenGraph / token_graph


@rg.token_graph
class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = ToyStack(layers=2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.stack(x)


@rg.token_graph(per_phase=True)
class PhaseUnit(Unit):
    pass


def _token_plan(tg: rg.TokenGraph, rows: int) -> StepPlan:
    """The plan of a decode step of `rows` one-row sequences over tg's decode buckets."""
    return ForwardMode.decide(CUDAGraphMode.TR_HYBRID, CUDAGraphMode.TR_HYBRID,
                              is_prefill=False, num_seqs=rows, num_tokens=rows, q_len=1,
                              token_sizes=tg.captured_sizes("decode"), req_keys=[])


def _req_plan(reqs: rg.ReqGraph, seqs: int, q_len: int = 1) -> StepPlan:
    """The plan of a decode step of `seqs` sequences of q_len rows over reqs' buckets."""
    return ForwardMode.decide(CUDAGraphMode.FULL, CUDAGraphMode.NONE, is_prefill=False,
                              num_seqs=seqs, num_tokens=seqs * q_len, q_len=q_len,
                              token_sizes=[], req_keys=reqs.keys())


def _ctx(n: int, prefill: bool, tr: str | None) -> dict:
    return dict(attn_metadata=AttentionMetaData(slot_mapping=torch.arange(n)),
                context=Context(is_prefill=prefill, batch_size=n), tr_graph=tr)


def test_token_graph_unit_records_replays_and_passes_through() -> None:
    unit = Unit()
    assert rg.is_token_graph_unit(unit) and not rg.is_token_graph_unit(nn.Linear(1, 1))
    tg = rg.token_graph_of(unit)
    tg.recorder_factory = CpuOpRecorder
    recorded = counters.get("graphs_recorded")
    for n in (4, 2):
        with forward_context(**_ctx(n, False, "record")):
            unit(torch.zeros(n, 3))
    assert counters.get("graphs_recorded") - recorded == 2
    assert tg.captured_sizes("decode") == [2, 4] and tg.captured_sizes("prefill") == []
    # the plan pads a 3-row decode step to the 4-row recording; 5 rows fit none: eager
    assert _token_plan(tg, 3) == StepPlan(StepKind.TOKEN_GRAPH, 4, 4, phase="decode")
    assert _token_plan(tg, 5).kind == StepKind.EAGER

    # The prefill pass claims the recordings without recording again.
    with forward_context(**_ctx(4, True, "record")):
        unit(torch.zeros(4, 3))
    assert counters.get("graphs_recorded") - recorded == 2
    assert tg.captured_sizes("prefill") == [4]

    calls = unit.calls
    x = torch.randn(4, 3)
    replays = counters.get("graph_replays")
    with forward_context(**_ctx(4, True, "replay")):
        got = unit(x)
    assert unit.calls == calls  # replayed, the Python forward did not run
    assert counters.get("graph_replays") - replays == 1
    torch.testing.assert_close(got, _expected(x, torch.arange(4).float(), 2))
    with forward_context(**_ctx(2, True, "replay")), pytest.raises(KeyError, match="prefill"):
        unit(torch.zeros(2, 3))  # 2 was recorded for decode only
    with forward_context(**_ctx(3, False, None)):
        eager = unit(x[:3])
    assert unit.calls == calls + 1
    torch.testing.assert_close(eager, _expected(x[:3], torch.arange(3).float(), 2))
    with forward_context(**_ctx(4, False, "bogus")), pytest.raises(ValueError, match="tr_graph"):
        unit(x)


def test_per_phase_unit_records_each_phase() -> None:
    unit = PhaseUnit()
    tg = rg.token_graph_of(unit)
    assert tg.per_phase
    tg.recorder_factory = CpuOpRecorder
    for prefill in (False, True):
        with forward_context(**_ctx(4, prefill, "record")):
            unit(torch.zeros(4, 3))
    assert len(tg) == 2
    assert tg.captured_sizes("prefill") == tg.captured_sizes("decode") == [4]
    with pytest.raises(ValueError, match="phase"):
        tg.captured_sizes("mixed")


# ----------------------------------------------------------------- ReqGraph


def test_request_bucket() -> None:
    assert rg.request_bucket(8, 1) == (8, 0)
    assert rg.request_bucket(4, 3) == (4, 2)  # two draft tokens verified per request
    assert rg.request_bucket(1, 0) == (1, 0)


def test_req_graph_copies_live_metadata_into_the_recorded_tensors() -> None:
    model = ToyStack(layers=2)
    reqs = rg.ReqGraph(recorder_factory=CpuOpRecorder)
    static_slots = {n: torch.zeros(n, dtype=torch.int64) for n in (2, 4)}
    static_x = {n: torch.zeros(n, 3) for n in (2, 4)}
    for n in (4, 2):
        with forward_context(attn_metadata=AttentionMetaData(slot_mapping=static_slots[n])):
            reqs.record((n, 0), model, (static_x[n],))
    assert reqs.keys() == [(2, 0), (4, 0)]
    assert _req_plan(reqs, 3).key == (4, 0) and _req_plan(reqs, 5).kind == StepKind.EAGER
    assert _req_plan(reqs, 1, q_len=2).kind == StepKind.EAGER  # no (bs, 1) bucket recorded
    with pytest.raises(ValueError, match="already"):
        reqs.record((2, 0), model, (static_x[2],))

    live_slots = torch.tensor([5, 1, 7, 2])
    x = torch.randn(4, 3)
    with forward_context(attn_metadata=AttentionMetaData(slot_mapping=live_slots)):
        got = reqs.replay((4, 0), (x,))
    assert static_slots[4].tolist() == [5, 1, 7, 2]  # copied to the recorded address
    torch.testing.assert_close(static_x[4], x)
    torch.testing.assert_close(got, _expected(x, live_slots.float(), 2))
    with forward_context(attn_metadata=AttentionMetaData(slot_mapping=torch.zeros(3))), \
            pytest.raises(ValueError, match="pad the step"):
        reqs.replay((4, 0), (torch.zeros(3, 3),))


def test_copy_into_static_allows_narrower_trailing_dims() -> None:
    static = torch.zeros(2, 4, dtype=torch.int32)
    rg._copy_into_static([static], [torch.ones(2, 3, dtype=torch.int32)])
    assert static.tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    with pytest.raises(ValueError):
        rg._copy_into_static([static], [torch.ones(2, 5, dtype=torch.int32)])


def test_graph_pool_is_renewed_once_all_its_graphs_are_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The allocator refuses captures into a pool whose graphs are all destroyed (use_count
    0): graph_pool() must hand out a new pool then, and keep the pool while one graph lives."""
    import gc
    import itertools

    ids = itertools.count(1)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, next(ids)))
    pool = GraphPool()  # the process's GRAPH_POOL stays untouched

    class Graph:  # stands in for torch.cuda.CUDAGraph (weak-referenceable)
        pass

    p1 = pool.get()
    assert pool.get() == p1  # unused: kept
    g1, g2 = Graph(), Graph()
    pool.track(g1, p1)
    pool.track(g2, p1)
    del g1
    gc.collect()
    assert pool.get() == p1  # g2 still holds it
    del g2
    gc.collect()
    p2 = pool.get()
    assert p2 != p1
    pool.track(Graph(), p1)  # a graph of the old pool does not count for the new one
    assert pool.get() == p2


# ----------------------------------------------------------------- regions the bucket fixes


def _inline_for_decode() -> bool:
    ctx = get_forward_context().context
    return ctx is not None and not ctx.is_prefill


@rg.eager_region(inline_when=_inline_for_decode)
def _shift_inline(h: torch.Tensor, out: torch.Tensor, layer_id: int) -> None:
    md = get_forward_context().attn_metadata
    out.copy_(h + md.slot_mapping.to(h.dtype)[:, None] + layer_id)


direct_register_custom_op("shift_inline", _shift_inline, mutates_args=["out"],
                          fake_impl=_shift_fake, target_lib=_lib, dispatch_key="CPU")


class InlineStack(ToyStack):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.layers):
            h = x * 2
            out = torch.empty_like(h)
            torch.ops.atomgraphtest.shift_inline(h, out, i)
            x = out
        return x * 3 + 19


@rg.token_graph
class InlineUnit(Unit):
    def __init__(self) -> None:
        super().__init__()
        self.stack = InlineStack(layers=2)


def test_region_inlined_for_decode_serves_decode_only_and_takes_live_metadata() -> None:
    unit = InlineUnit()
    tg = rg.token_graph_of(unit)
    tg.recorder_factory = CpuOpRecorder
    recorded = counters.get("graphs_recorded")
    static = {p: torch.arange(4) for p in ("decode", "prefill")}
    for phase in ("decode", "prefill"):
        with forward_context(attn_metadata=AttentionMetaData(slot_mapping=static[phase]),
                             context=Context(is_prefill=phase == "prefill", batch_size=4),
                             tr_graph="record"):
            unit(torch.zeros(4, 3))
    # The decode recording holds its regions inline, so the prefill pass records its own.
    assert counters.get("graphs_recorded") - recorded == 2
    dec, pre = tg.recording("decode", 4), tg.recording("prefill", 4)
    assert dec is not pre
    assert len(dec.segments) == 1 and not dec.regions and dec.static_metadata is not None
    assert len(pre.segments) == 3 and len(pre.regions) == 2 and not pre.static_metadata

    live = torch.tensor([9, 3, -1, 4])
    x = torch.randn(4, 3)
    runs = counters.get("eager_region_runs")
    with forward_context(attn_metadata=AttentionMetaData(slot_mapping=live),
                         context=Context(is_prefill=False, batch_size=4), tr_graph="replay"):
        got = unit(x)
    assert static["decode"].tolist() == live.tolist()  # live metadata copied to the recorded address
    assert counters.get("eager_region_runs") == runs  # nothing ran between segments
    torch.testing.assert_close(got, _expected(x, live.float(), 2))
