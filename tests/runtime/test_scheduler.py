"""Continuous batching: token budget, sequence cap, chunked prefill, preemption, and (with a
model) identical greedy output after preemption and resumption."""

from __future__ import annotations

import pytest

from atom.engine.block_manager import BlockManager
from atom.engine.params import SamplingParams
from atom.engine.scheduler import Scheduler
from atom.engine.sequence import Sequence, SequenceStatus


def _sched(blocks: int = 64, seqs: int = 8, budget: int = 64, chunked: bool = True) -> Scheduler:
    return Scheduler(BlockManager(blocks, 16), max_num_seqs=seqs, max_num_batched_tokens=budget,
                     max_model_len=512, enable_chunked_prefill=chunked)


def _add(s: Scheduler, n_prompts: int, length: int) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", [1] * length, SamplingParams(), arrival=i) for i in range(n_prompts)]
    for q in seqs:
        s.add(q)
    return seqs


def _finish_step(out) -> None:
    """What the engine does after a step: count computed tokens, append a sampled token."""
    for seq in out.seqs:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def test_token_budget_and_chunked_prefill() -> None:
    s = _sched(budget=64)
    a, b, c = _add(s, 3, 40)
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["r0", "r1"]
    assert (a.num_scheduled_tokens, b.num_scheduled_tokens) == (40, 24)  # b is chunked
    assert out.num_tokens == 64 and out.is_prefill
    _finish_step(out)
    out = s.schedule()
    # a decodes (1), b finishes its prompt (16), c gets the rest of the budget (47 > 40: all of it)
    assert [(q.request_id, q.num_scheduled_tokens) for q in out.seqs] == [("r0", 1), ("r1", 16), ("r2", 40)]
    assert out.num_tokens <= 64
    _finish_step(out)
    out = s.schedule()
    assert [q.num_scheduled_tokens for q in out.seqs] == [1, 1, 1] and not out.is_prefill


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = _sched(budget=64, chunked=False)
    _add(s, 2, 40)
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["r0"]


def test_max_num_seqs_caps_running() -> None:
    s = _sched(seqs=2, budget=1000)
    _add(s, 5, 10)
    out = s.schedule()
    assert len(out.seqs) == 2 and len(s.running) == 2 and len(s.waiting) == 3
    _finish_step(out)
    assert len(s.schedule().seqs) == 2


def test_preemption_frees_blocks_and_requeues_latest_first_in_line() -> None:
    # 4 blocks of 16: two sequences of 32 tokens fill the cache; the next decode needs a block.
    s = _sched(blocks=4, budget=1000)
    a, b = _add(s, 2, 32)
    out = s.schedule()
    assert len(out.seqs) == 2 and s.bm.num_free_blocks == 0
    _finish_step(out)
    out = s.schedule()
    assert out.preempted == [b]  # the latest arrival makes room
    assert [q.request_id for q in out.seqs] == ["r0"]
    assert b.status == SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.num_tokens == 33  # its sampled token is kept for recompute
    assert s.num_preemptions == 1


def test_a_sequence_that_cannot_grow_alone_preempts_itself() -> None:
    s = _sched(blocks=2, budget=1000)
    (a,) = _add(s, 1, 32)
    _finish_step(s.schedule())
    out = s.schedule()
    assert out.preempted == [a] and not out.seqs and s.waiting[0] is a


@pytest.fixture(scope="module")
def engines():
    from atom.config import Config
    from atom.engine import LLMEngine

    def make(**kw):
        base = dict(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu",
                    max_model_len=96, seed=3)
        base.update(kw)
        return LLMEngine(Config(**base))

    return make


PROMPTS = [[1] + [(7 * i + 3 * j) % 250 + 3 for j in range(25 + 3 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_preemption_and_resumption_keep_greedy_output(engines) -> None:
    roomy = engines(num_kv_blocks=128)
    expected = [roomy.generate([p], GREEDY)[0] for p in PROMPTS]  # each alone: no preemption
    # 8 blocks x 16 = 128 tokens for six sequences of ~50 tokens each: preemption is certain.
    tight = engines(num_kv_blocks=8)
    got = tight.generate(PROMPTS, GREEDY)
    assert tight.scheduler.num_preemptions > 0
    assert got == expected
    assert all(len(g) == 24 for g in got)
    assert tight.block_manager.num_used_blocks == 0


def test_chunked_prefill_and_max_num_seqs_keep_output(engines) -> None:
    roomy = engines(num_kv_blocks=128)
    expected = roomy.generate(PROMPTS, GREEDY)
    # a 16-token budget splits every prompt (26+ tokens) into chunks
    small = engines(num_kv_blocks=128, max_num_batched_tokens=16, max_num_seqs=2)
    for i, p in enumerate(PROMPTS):
        small.add_request(str(i), p, GREEDY)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    peak_running = 0
    while small.has_unfinished_requests():
        outs = small.step()
        peak_running = max(peak_running, small.stats()["running"])
        for o in outs:
            got[o.request_id].extend(o.new_token_ids)
    assert peak_running == 2
    assert [got[str(i)] for i in range(len(PROMPTS))] == expected
