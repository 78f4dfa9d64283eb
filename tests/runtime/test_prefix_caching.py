"""Automatic prefix caching in the engine: the same greedy tokens with caching on and off (shared
prefixes of 0, 1, partial and many blocks, preemption, aborts, chunked prefill, async and sync
steps, P/D holds, eviction and recompute, a level-3 compiled model), and the cached tokens the
API reports. test_prefix_cache_blocks.py holds the block manager's own tests."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_engine, tiny_tokens

from atom.config import CompilationConfig
from atom.engine import LLMEngine, SamplingParams
from atom.engine.sequence import Sequence

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


# ---- engine parity -------------------------------------------------------------------------------
def _engine(prefix: bool, **kw) -> LLMEngine:
    base = dict(max_model_len=128, max_num_seqs=4, seed=3, enable_prefix_caching=prefix)
    return tiny_engine(**{**base, **kw})


SYSTEM = [1] + tiny_tokens(79, 4)  # five full blocks
# Shared prefixes of 0, 1 token, a partial block (20 tokens), one block, many blocks.
WAVES = [
    [("a0", SYSTEM + tiny_tokens(7, 1)), ("b0", [2] + tiny_tokens(30, 2))],
    [
        ("a1", SYSTEM + tiny_tokens(9, 3)),
        ("b1", [2] + tiny_tokens(11, 5)),
        ("c1", SYSTEM[:20] + tiny_tokens(12, 6)),
        ("d1", SYSTEM[:16] + tiny_tokens(5, 7)),
    ],
    [
        ("a2", SYSTEM + tiny_tokens(7, 1)),
        ("c2", SYSTEM[:20] + tiny_tokens(12, 6)),
        ("e2", tiny_tokens(3, 8)),
        ("f2", SYSTEM[:48]),
    ],
]


def _run_waves(
    engine: LLMEngine,
    waves,
    aborts: dict[str, int] | None = None,
    params: SamplingParams = GREEDY,
    held: int = 0,
) -> dict[str, list[int]]:
    """Each wave is added at once and run to completion; aborts: request id -> the step (of
    its wave) at which it is aborted."""
    got: dict[str, list[int]] = {}
    for wave in waves:
        for rid, prompt in wave:
            engine.add_request(rid, prompt, params)
            got[rid] = []
        step = 0
        while engine.has_unfinished_requests():
            for rid, at in (aborts or {}).items():
                if at == step and rid in got and rid in {r for r, _ in wave}:
                    engine.abort_request(rid)
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
            step += 1
    assert engine.block_manager.num_used_blocks == held  # only P/D holds keep blocks
    return got


def _run_one(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], int | None]:
    """One request run to the end: its tokens and the cached tokens its outputs report."""
    engine.add_request(rid, prompt, GREEDY)
    got: list[int] = []
    cached = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    return got, cached


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_same_tokens_with_caching_on_and_off(async_scheduling: bool) -> None:
    off = _run_waves(_engine(False, async_scheduling=async_scheduling), WAVES)
    on_engine = _engine(True, async_scheduling=async_scheduling)
    on = _run_waves(on_engine, WAVES)
    assert on == off
    stats = on_engine.prefix_cache_stats()
    assert stats["prefix_cache_hits"] > 0 and stats["prefix_cache_requests_hit"] >= 4


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_prompt_found_whole_computes_one_decode_row_and_writes_no_shared_block(
    async_scheduling: bool,
) -> None:
    """A repeated prompt that ends on a block boundary shares every block: its last token is
    computed again for its logits in a decode step (no prefill), stores nothing in the shared
    block, and the tokens equal caching off."""
    prompt = SYSTEM[:64]  # four full blocks
    off = _run_waves(_engine(False, async_scheduling=async_scheduling), [[("p", prompt)]])
    engine = _engine(True, async_scheduling=async_scheduling)
    first = _run_waves(engine, [[("first", prompt)]])["first"]
    bm, cache = engine.block_manager, engine.runner.kv_cache
    seq = Sequence("probe", prompt, GREEDY)
    blocks = bm.match_prefix(seq)
    assert len(blocks) == 4
    before = cache[:, :, blocks].clone()
    phases: list[bool] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        if out:
            phases.append(out.is_prefill)
        return out

    engine.scheduler.schedule = spy
    got, cached = _run_one(engine, "again", prompt)
    assert got == first == off["p"]
    assert cached == 63
    assert phases and not any(phases)  # its first step was a decode step, as every later one
    assert torch.equal(cache[:, :, blocks], before)


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_cached_tokens_reported_per_request() -> None:
    engine = _engine(True)
    seen: dict[str, int] = {}
    for rid, prompt in [("x", SYSTEM + [5]), ("y", SYSTEM + [6, 7]), ("z", tiny_tokens(20, 9))]:
        engine.add_request(rid, prompt, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen[out.request_id] = out.num_cached_tokens
    assert seen == {"x": 0, "y": 80, "z": 0}


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_preemption_chunked_prefill_and_aborts_keep_tokens() -> None:
    """A small pool (preemption, eviction), a small token budget (chunked prefill over cached
    prefixes) and aborts mid-prefill and mid-decode, against an engine without caching."""
    kw = dict(num_kv_blocks=9, max_num_batched_tokens=32)
    aborts = {"b1": 1, "d1": 4, "c2": 2}
    off_engine = _engine(False, **kw)
    off = _run_waves(off_engine, WAVES, aborts)
    on_engine = _engine(True, **kw)
    on = _run_waves(on_engine, WAVES, aborts)
    for rid in off:
        if rid not in aborts:
            assert on[rid] == off[rid], rid
            assert len(on[rid]) == GREEDY.max_tokens
    assert on_engine.scheduler.num_preemptions > 0
    assert on_engine.block_manager.stats.evicted_blocks > 0
    assert on_engine.block_manager.stats.hits > 0


def test_a_request_after_eviction_recomputes_correctly() -> None:
    engine = _engine(True, num_kv_blocks=10)
    first = _run_waves(engine, [[("p", SYSTEM + [3])]])["p"]
    assert engine.block_manager.num_cached_blocks == 5
    _run_waves(engine, [[(f"o{i}", [2 + i] + tiny_tokens(100, i)) for i in range(2)]])  # fill the pool
    assert engine.block_manager.stats.evicted_blocks > 0
    assert len(engine.block_manager.match_prefix(Sequence("q", SYSTEM + [3], GREEDY))) < 5
    got, cached = _run_one(engine, "again", SYSTEM + [3])
    assert got == first and cached is not None and cached < 80


def test_seeded_sampling_is_the_same_with_a_cached_prefix() -> None:
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=4, max_tokens=6, ignore_eos=True)
    waves = [[("s0", SYSTEM + [4])], [("s1", SYSTEM + [4]), ("s2", SYSTEM[:40] + [8])]]
    assert _run_waves(_engine(True), waves, params=seeded) == _run_waves(
        _engine(False), waves, params=seeded
    )


def test_prefill_holds_share_cached_blocks_and_are_not_evicted() -> None:
    """A prefill-role request keeps its prompt's blocks (a P/D hold): they stay in use while
    held, other prompts hit them, and they return to the pool when the hold ends."""
    engine = _engine(True, num_kv_blocks=12)
    engine.add_request(
        "h", SYSTEM + [9], SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True
    )
    while engine.has_unfinished_requests():
        engine.step()
    held = engine.kv_holds._holds["h"].block_ids
    assert len(held) == 6 and engine.block_manager.num_used_blocks == 6
    expected = _run_waves(_engine(False), [[("q", SYSTEM + [1, 2])]])["q"]
    # another prompt with the same system prompt hits the held blocks; pressure evicts nothing held
    engine.add_request("q", SYSTEM + [1, 2], GREEDY)
    got: list[int] = []
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    assert got == expected and cached == 80
    _run_waves(engine, [[("big", [2] + tiny_tokens(79, 3))]], held=6)  # needs all 6 other blocks
    assert all(engine.block_manager.ref_counts[b] >= 1 for b in held)
    assert engine.kv_holds.release("h")
    assert engine.reclaim_kv() == 6
    assert engine.block_manager.num_used_blocks == 0


def test_pulled_blocks_are_registered() -> None:
    """A decode instance's pulled prompt (add_prefilled_request) becomes cached blocks too."""
    import torch

    src = _engine(True)
    src.add_request("p", SYSTEM + [5], SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    first: list[int] = []
    while src.has_unfinished_requests():
        for out in src.step():
            first.extend(out.new_token_ids)
    blocks = src.kv_holds._holds["p"].block_ids
    payload = torch.stack([src.runner.kv_cache[:, :, b] for b in blocks])
    dst = _engine(True)
    # the prefill instance's hit travels in the handle and is reported by the decode instance
    dst.add_prefilled_request("p", SYSTEM + [5], first[0], GREEDY, payload, cached_tokens=64)
    reported = set()
    while dst.has_unfinished_requests():
        reported |= {out.num_cached_tokens for out in dst.step() if out.request_id == "p"}
    assert reported == {64}
    assert dst.block_manager.num_cached_blocks >= 5
    expected = _run_waves(_engine(False), [[("r", SYSTEM + [6])]])["r"]
    got = _run_waves(dst, [[("r", SYSTEM + [6])]])["r"]
    assert got == expected and dst.block_manager.stats.hits == 80


def test_handle_carries_cached_tokens() -> None:
    from atom.disagg.handle import KVHandle

    h = KVHandle("h", None, 8001, "id", "m", 2, [1, 2, 3], 7, cached_tokens=16)
    assert KVHandle.from_dict(h.to_dict()).cached_tokens == 16
    old = {k: v for k, v in h.to_dict().items() if k != "cached_tokens"}  # an older prefill
    assert KVHandle.from_dict(old).cached_tokens == 0


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_level_3_compiled_model_same_tokens_with_caching() -> None:
    kw = dict(compilation_config=CompilationConfig(level=3), max_num_batched_tokens=48)
    waves = WAVES[:2]
    on = _run_waves(_engine(True, **kw), waves)
    off = _run_waves(_engine(False, **kw), waves)
    assert on == off


# ---- server: usage, /metrics, /status --------------------------------------------------------------
@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_openai_client_sees_cached_tokens_and_metrics_count_them() -> None:
    import httpx
    import openai
    from prometheus_client.parser import text_string_to_metric_families
    from server_proc import start_server

    proc = start_server("--num-kv-blocks", "64", "--max-num-seqs", "4", "--max-model-len", "256")
    try:
        proc.wait_healthy()
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=60)
        prompt = SYSTEM + [7, 8]  # 82 tokens: five full blocks can be cached
        first = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0
        )
        again = client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=4, temperature=0
        )
        assert first.usage.prompt_tokens == again.usage.prompt_tokens == 82
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == 80
        assert again.choices[0].text == first.choices[0].text
        stream = client.completions.create(
            model="tiny-llama",
            prompt=prompt,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = [c.usage for c in stream if c.usage is not None]
        assert usage[-1].prompt_tokens_details.cached_tokens == 80
        text = httpx.get(proc.url + "/metrics").text
        values = {
            s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
        }
        assert values["atom_prefix_cache_queries_total"] == 3 * 82
        assert values["atom_prefix_cache_hits_total"] == 2 * 80
        assert values["atom_prefix_cache_requests_hit_total"] == 2
        assert values["atom_kv_blocks_cached"] >= 5 and "atom_kv_blocks_cached_idle" in values
        status = httpx.get(proc.url + "/status").json()
        assert status["enable_prefix_caching"] is True
        assert status["prefix_cache"]["hit_rate"] == round(160 / 246, 4)
    finally:
        proc.stop()


def test_cli_turns_prefix_caching_off() -> None:
    from atom.cli.args import build_parser
    from atom.cli.config import config_from_args

    parser = build_parser()
    on = config_from_args(parser.parse_args(["serve", "--model", "tiny-llama"]))
    off = config_from_args(
        parser.parse_args(["serve", "--model", "tiny-llama", "--no-enable-prefix-caching"])
    )
    assert on.enable_prefix_caching is True and off.enable_prefix_caching is False
    # not a compile input: the compile cache is shared by both settings
    assert on.compile_hash_factors() == off.compile_hash_factors()


@pytest.mark.gpu
@pytest.mark.parametrize("level", [0, 3])
@pytest.mark.parametrize("mode", ["FULL_DECODE_ONLY", "TR_HYBRID"])
def test_cuda_graphs_same_tokens_with_caching(level: int, mode: str) -> None:
    """On CUDA a prefill starting at a cached offset runs eagerly or on a prefill token bucket
    (the Triton prefill kernel reads the cached blocks through the block table), and a prompt
    left with one token to compute can ride a decode graph: tokens equal caching off, and the
    graphs did replay."""
    import torch

    from atom.utils.counters import counters

    def make(prefix: bool) -> LLMEngine:
        cc = CompilationConfig(
            level=level, cudagraph_mode=mode, cudagraph_capture_sizes=[1, 2, 4, 8]
        )
        return _engine(
            prefix,
            device="cuda",
            max_num_seqs=8,
            # a fixed pool: two engines of one process would otherwise each size theirs from
            # what the other left free
            num_kv_blocks=512,
            compilation_config=cc,
        )

    waves = [*WAVES, [("g1", SYSTEM + [11]), ("g2", SYSTEM[:32] + [12])]]
    off = _run_waves(make(False), waves)
    torch.cuda.empty_cache()
    with counters.track() as run:
        on = _run_waves(make(True), waves)
    assert on == off
    assert run.get("graph_replays", 0) > 0
    torch.cuda.empty_cache()


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_next_turn_hits_blocks_written_by_decode_and_a_stop(async_scheduling: bool) -> None:
    """A chat's next turn is the last prompt + its reply + a new message: it hits blocks filled
    by decode steps (whose tokens were pending when launched), including the block whose last
    slot holds the stop token (under async scheduling that key/value was written by a step
    launched before the stop was read)."""
    prompt = [1] + tiny_tokens(28, 5)  # 29 tokens: output index 2 lands on position 31, a block's end
    on, off = _engine(True, async_scheduling=async_scheduling), _engine(False)
    full = off.generate([prompt], GREEDY)[0]
    stop = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[full[2]])
    ended = on.generate([prompt], stop)[0]
    assert ended == full[: full.index(full[2]) + 1]
    turn2 = prompt + ended + tiny_tokens(5, 6)
    expected = off.generate([turn2], GREEDY)[0]
    before = on.block_manager.stats.hits
    assert on.generate([turn2], GREEDY)[0] == expected
    hit = on.block_manager.stats.hits - before
    # the stop token's key/value exists only if a step computed it: under async scheduling the
    # step launched before the stop was read did; synchronously nothing does
    computed = len(prompt) + len(ended) - (0 if async_scheduling else 1)
    assert hit == 16 * (computed // 16)
    long_reply = on.generate(
        [turn2], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )[0]
    turn3 = turn2 + long_reply + [9]
    before = on.block_manager.stats.hits
    assert on.generate([turn3], GREEDY)[0] == off.generate([turn3], GREEDY)[0]
    assert on.block_manager.stats.hits - before >= 16 * ((len(turn2) + 30) // 16)


@pytest.mark.slow  # 10-60 s on a loaded 2-core machine
def test_randomized_arrivals_stops_aborts_and_preemption_match_caching_off() -> None:
    """A scripted mix (fixed seed): shared prefixes of several lengths, arrivals at random
    steps, stop tokens, aborts and a pool small enough to preempt and evict."""
    import random

    rng = random.Random(11)
    bases = [[1] + tiny_tokens(n, s) for s, n in ((1, 47), (2, 20), (3, 70))]
    reqs = []
    for i in range(14):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(1, len(base) + 1)] + tiny_tokens(rng.randrange(0, 12), 20 + i)
        stops = [rng.randrange(3, 250) for _ in range(3)]
        params = SamplingParams(
            temperature=0.0, max_tokens=rng.randrange(1, 14), stop_token_ids=stops, ignore_eos=True
        )
        reqs.append((f"r{i}", prompt, params, rng.randrange(0, 30)))
    aborts = {"r3": 6, "r8": 20}

    def run(prefix: bool) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = _engine(prefix, num_kv_blocks=10, max_num_batched_tokens=40)
        got: dict[str, list[int]] = {rid: [] for rid, *_ in reqs}
        step = 0
        while step <= 30 or engine.has_unfinished_requests():
            for rid, prompt, params, at in reqs:
                if at == step:
                    engine.add_request(rid, prompt, params)
            for rid, at in aborts.items():
                if at == step:
                    engine.abort_request(rid)
            for out in engine.step():
                got[out.request_id].extend(out.new_token_ids)
            step += 1
            assert step < 2000
        assert engine.block_manager.num_used_blocks == 0
        return got, engine

    on, on_engine = run(True)
    off, off_engine = run(False)
    assert {k: v for k, v in on.items() if k not in aborts} == {
        k: v for k, v in off.items() if k not in aborts
    }
    assert on_engine.block_manager.stats.hits > 0
    assert on_engine.scheduler.num_preemptions + off_engine.scheduler.num_preemptions > 0
