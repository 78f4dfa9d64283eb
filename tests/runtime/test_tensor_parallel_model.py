"""Tensor parallelism, model side, on the CPU with gloo: two ranks in spawned processes.

The sharded layers equal the unsharded ones; a whole model at TP = 2 (Llama, Qwen2 with
q/k/v bias) gives TP = 1's logits and greedy tokens in fp32; each rank reads only its
slices of the checkpoint; dummy weights at TP = 2 are TP = 1's, cut; indivisible sizes
fail with the field named; the collectives trace without a graph break and stay inside the
compiled pieces; every recording drains the NCCL watchdog first.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from atom.config import CompilationConfig, Config
from atom.distributed import nccl_watchdog
from atom.distributed.parallel_state import (
    TPState,
    check_visible_devices,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from atom.engine.batch import StepBatch
from atom.engine.model_runner import ModelRunner
from atom.engine.params import SamplingParams
from atom.engine.sequence import Sequence
from atom.models.registry import load_model_config

transformers = pytest.importorskip("transformers")

TP = 2
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2)
PROMPTS = [[1, 17, 33, 5, 90, 12, 7], [1, 100, 3, 64, 65]]
DECODE_STEPS = 4
BLOCKS_PER_SEQ = 4  # 16-token blocks: prompt plus decode steps fit in one; spare ones unused


# ---- helpers run in the parent and in the ranks ---------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn: Any, *args: Any) -> list[Any]:
    """fn(rank, out_dir, *args) in TP processes joined by gloo; each rank's torch.save'd
    result, in rank order."""
    import tempfile

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(fn, _free_port(), out_dir, args), nprocs=TP, join=True)
        return [torch.load(os.path.join(out_dir, f"{r}.pt"), weights_only=False)
                for r in range(TP)]


def _rank_main(rank: int, fn: Any, port: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)  # two ranks on a shared two-core machine
    init_tensor_parallel(rank, TP, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
    try:
        result = fn(rank, *args)
    finally:
        destroy_tensor_parallel()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def _config(path: str, tp: int, load_format: str = "safetensors", level: int = 0) -> Config:
    return Config(model=path, load_format=load_format, dtype="float32", device="cpu",
                  max_model_len=128, num_kv_blocks=16, max_num_seqs=4, enforce_eager=level == 0,
                  tensor_parallel_size=tp,
                  compilation_config=CompilationConfig(level=level, use_inductor=False,
                                                       cache_dir=os.path.join(path, "cc")))


def _greedy(runner: ModelRunner) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill both prompts in one step, then DECODE_STEPS batched greedy decode steps:
    every step's logits and the tokens."""
    seqs = [Sequence(f"s{i}", p, SamplingParams()) for i, p in enumerate(PROMPTS)]
    for i, s in enumerate(seqs):
        s.block_table = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
        s.num_scheduled_tokens = len(s.token_ids)
    all_logits, prefill = [], True
    for _ in range(DECODE_STEPS + 1):
        ids, _, meta, ctx = runner.prepare_inputs(StepBatch.of(seqs, prefill))
        with runner.step_context(meta, ctx), torch.inference_mode():
            logits, _ = runner.run_model(ids)
        ends = torch.tensor(meta.cu_seqlens_q[1:len(seqs) + 1].tolist()) - 1 if prefill else None
        rows = logits[ends] if prefill else logits[:len(seqs)]
        all_logits.append(rows.clone())
        for s, row in zip(seqs, rows, strict=True):
            s.num_computed_tokens += s.num_scheduled_tokens
            s.token_ids.append(int(row.argmax()))
            s.num_scheduled_tokens = 1
        prefill = False
    return all_logits, [s.output_token_ids for s in seqs]


def _runner(path: str, tp: int, load_format: str = "safetensors") -> ModelRunner:
    cfg = _config(path, tp, load_format)
    runner = ModelRunner(cfg, load_model_config(path))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    return runner


# ---- what the ranks run ---------------------------------------------------------------

def _rank_model(rank: int, path: str) -> dict[str, Any]:
    """Load with counted reads, run the greedy steps, report what was read and held."""
    import atom.models.loader as loader

    reads = {"slice_bytes": 0, "whole": [], "sliced": []}
    real_open = loader.safe_open

    class CountingFile:
        def __init__(self, f: Any) -> None:
            self.f = f

        def keys(self) -> Any:
            return self.f.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            reads["whole"].append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name: str) -> Any:
            inner = self.f.get_slice(name)
            return CountingSlice(inner, name)

    class CountingSlice:
        def __init__(self, inner: Any, name: str) -> None:
            self.inner, self.name = inner, name

        def get_shape(self) -> list[int]:
            return self.inner.get_shape()

        def __getitem__(self, index: Any) -> torch.Tensor:
            t = self.inner[index]
            reads["slice_bytes"] += t.numel() * t.element_size()
            reads["sliced"].append(self.name)
            return t

    class CountingOpen:
        def __init__(self, *a: Any, **kw: Any) -> None:
            self.ctx = real_open(*a, **kw)

        def __enter__(self) -> CountingFile:
            return CountingFile(self.ctx.__enter__())

        def __exit__(self, *exc: Any) -> None:
            self.ctx.__exit__(*exc)

    loader.safe_open = CountingOpen
    try:
        runner = _runner(path, TP)
    finally:
        loader.safe_open = real_open
    shards = runner.model.hf_weight_shards()
    logits, tokens = _greedy(runner)
    dummy = ModelRunner(_config(path, TP, "dummy"), load_model_config(path)).model
    return {
        "reads": reads,
        "shards": {n: (t.shard, t.tensor.clone()) for n, t in shards.items()},
        "dummy": {n: (t.shard, t.tensor.clone()) for n, t in dummy.hf_weight_shards().items()},
        "kv_shape": tuple(runner.kv_cache.shape),
        "kv_block_bytes": runner.kv_block_bytes(),
        "logits": logits, "tokens": tokens,
        "drain": nccl_watchdog.drain_nccl_works(),
    }


def _rank_compiled(rank: int, path: str) -> dict[str, Any]:
    """Piecewise compilation (level 3, eager pieces: Inductor's CPU compile is the slow part
    and not what is tested) of the sharded model, with its counters."""
    from atom.utils.counters import counters

    before = counters.snapshot()
    cfg = _config(path, TP, level=3)
    runner = ModelRunner(cfg, load_model_config(path))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    logits, tokens = _greedy(runner)
    return {"delta": counters.delta(before), "logits": logits, "tokens": tokens,
            "cache_dir": cfg.compilation_config.local_cache_dir,
            "layers": runner.hf_config.num_hidden_layers}


def _rank_layers(rank: int) -> dict[str, float]:
    """Each sharded layer against its full fp32 twin (weights cut from the same tensors)."""
    with torch.no_grad():
        return _layers(rank)


def _layers(rank: int) -> dict[str, float]:
    from atom.distributed.communication import (
        tensor_parallel_all_gather,
        tensor_parallel_all_reduce,
    )
    from atom.layers.linear import ColumnParallelLinear, Linear, MergedLinear, RowParallelLinear
    from atom.layers.norm_linear import linear_add
    from atom.layers.sharding import cut
    from atom.layers.vocab_embedding import VocabParallelEmbedding

    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 16, generator=g)
    errs: dict[str, float] = {}

    def fill(full: torch.nn.Module, part: torch.nn.Module) -> None:
        with torch.no_grad():
            for p in full.parameters():
                p.normal_(generator=g)
            whole = dict(full.named_parameters())
            for name, p in part.named_parameters():  # a shard is cut from its full twin
                p.copy_(cut(whole[name], p) if hasattr(p, "tp_pieces") else whole[name])

    sizes = {"q": 8, "k": 4, "v": 4}
    full_col, col = MergedLinear(16, sizes, bias=True), MergedLinear(16, sizes, True, TP, rank)
    fill(full_col, col)
    want = full_col(x).split(list(sizes.values()), dim=-1)
    got = col(x).split(list(col.shard_sizes.values()), dim=-1)
    errs["column"] = max(float((w.chunk(TP, -1)[rank] - o).abs().max())
                         for w, o in zip(want, got, strict=True))

    full_row, row = Linear(16, 12, bias=True), RowParallelLinear(16, 12, True, TP, rank)
    fill(full_row, row)
    residual = torch.randn(5, 12, generator=g)
    errs["row_bias_ranks"] = float((row.bias is not None) == (rank == 0))
    own = x.chunk(TP, -1)[rank]
    summed = tensor_parallel_all_reduce(linear_add(own, row, residual if rank == 0 else None))
    errs["row"] = float((summed - (full_row(x) + residual)).abs().max())

    full_emb = torch.nn.Embedding(32, 16)
    emb = VocabParallelEmbedding(32, 16, TP, rank)
    fill(full_emb, emb)
    ids = torch.tensor([0, 15, 16, 31, 3, 20])
    errs["embedding"] = float((emb(ids) - full_emb(ids)).abs().max())

    full_head = Linear(16, 32)
    head = ColumnParallelLinear(16, 32, tp_size=TP, tp_rank=rank, field="vocab_size")
    fill(full_head, head)
    errs["logits"] = float((tensor_parallel_all_gather(head(x)) - full_head(x)).abs().max())

    # Dynamo: the collectives trace as single nodes (fullgraph: a break would raise), and the
    # piecewise split at attention leaves them inside a compiled piece.
    from atom.compilation.splitting import op_name, split_graph

    seen: list[str] = []

    def backend(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
        seen.extend(op_name(n.target) or "" for n in gm.graph.nodes if n.op == "call_function")
        _, items = split_graph(gm, ["aiter.unified_attention_with_output"])
        seen.append(f"pieces={len(items)}:{sum(i.is_splitting_graph for i in items)}")
        return gm

    compiled = torch.compile(lambda t: tensor_parallel_all_gather(tensor_parallel_all_reduce(t)
                                                                  * 2), fullgraph=True,
                             backend=backend)
    errs["compiled"] = float((compiled(x) - torch.cat([x * 2 * TP] * TP, dim=-1)).abs().max())
    errs["ops"] = seen  # type: ignore[assignment]
    return errs


# ---- fixtures -------------------------------------------------------------------------

def _checkpoint(path: str, arch: str) -> str:
    torch.manual_seed(1234)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**COMMON, rms_norm_eps=1e-5, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    else:  # qwen2: q/k/v bias, tied embeddings (the logits reuse the vocab-parallel rows)
        cfg = transformers.Qwen2Config(**COMMON, rms_norm_eps=1e-6, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger than default weights: the logits separate tokens clearly
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.5 if name.endswith("bias") else 0.08)
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.float().save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[ModelRunner, list[dict[str, Any]], str]:
    path = _checkpoint(str(tmp_path_factory.mktemp(request.param)), request.param)
    ranks = _spawn(_rank_model, path)
    return _runner(path, 1), ranks, path


# ---- tests ----------------------------------------------------------------------------

def test_sharded_layers_equal_the_unsharded_layers() -> None:
    for rank, errs in enumerate(_spawn(_rank_layers)):
        ops = errs.pop("ops")
        assert errs.pop("row_bias_ranks") == 1.0, f"rank {rank}: the row bias is rank 0's"
        for name, err in errs.items():
            assert err < 1e-5, (rank, name, err)
        assert "atom.all_reduce" in ops and "atom.all_gather" in ops, ops
        assert "pieces=1:0" in ops, ops  # no split: the collectives stay in the compiled piece


def test_tp2_forward_and_greedy_decode_equal_tp1(tp_run) -> None:
    single, ranks, _ = tp_run
    logits, tokens = _greedy(single)
    for rank, r in enumerate(ranks):
        assert r["tokens"] == tokens, rank
        for step, (want, got) in enumerate(zip(logits, r["logits"], strict=True)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, s=step, k=rank: f"rank {k} step {s}: {m}")


def test_piecewise_compiled_tp2_traces_the_collectives_whole(tmp_path) -> None:
    """One Dynamo graph per rank (a graph break would hand the backend two), split only at
    attention: the collectives sit inside the pieces. Each rank caches under rank_<i>."""
    path = _checkpoint(str(tmp_path), "llama")
    want_logits, want_tokens = _greedy(_runner(path, 1))
    for rank, r in enumerate(_spawn(_rank_compiled, path)):
        assert r["delta"].get("graphs_compiled") == 1, r["delta"]
        assert r["delta"].get("pieces") == 2 * r["layers"] + 1, r["delta"]
        assert f"{os.sep}rank_{rank}{os.sep}" in r["cache_dir"] + os.sep, r["cache_dir"]
        assert r["tokens"] == want_tokens
        for want, got in zip(want_logits, r["logits"], strict=True):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_kv_cache_is_sharded_by_kv_head(tp_run) -> None:
    single, ranks, _ = tp_run
    heads = single.hf_config.num_key_value_heads
    for r in ranks:
        assert r["kv_shape"][4] == heads // TP
        assert r["kv_block_bytes"] * TP == single.kv_block_bytes()
    assert single.kv_cache.shape[4] == heads


def test_each_rank_reads_only_its_slices(tp_run) -> None:
    single, ranks, _ = tp_run
    full = single.model.hf_weight_shards()
    total = sum(t.tensor.numel() * 4 for t in full.values())
    for rank, r in enumerate(ranks):
        reads, shards = r["reads"], r["shards"]
        sharded = {n for n, (s, _) in shards.items() if s is not None}
        assert sharded and sharded == set(reads["sliced"]), rank
        assert not sharded & set(reads["whole"]), "a sharded tensor was read whole"
        held = sum(t.numel() * 4 for n, (_, t) in shards.items() if n in sharded)
        assert reads["slice_bytes"] == held
        assert held < 0.6 * sum(full[n].tensor.numel() * 4 for n in sharded)
        whole_bytes = sum(full[n].tensor.numel() * 4 for n in reads["whole"])
        assert reads["slice_bytes"] + whole_bytes < total
        for name, (shard, t) in shards.items():  # the slices are the right ones
            ref = full[name].tensor
            if shard is not None:
                ref = ref.narrow(shard.dim, shard.start, shard.length)
            assert torch.equal(t, ref), (rank, name)


def test_dummy_weights_at_tp2_are_tp1_cut(tp_run) -> None:
    _, ranks, path = tp_run
    single = ModelRunner(_config(path, 1, "dummy"), load_model_config(path)).model
    full = single.hf_weight_targets()
    for rank, r in enumerate(ranks):
        for name, (shard, t) in r["dummy"].items():
            ref = full[name] if shard is None else full[name].narrow(shard.dim, shard.start,
                                                                      shard.length)
            assert torch.equal(t, ref), (rank, name)


def test_drain_is_a_counted_noop_on_gloo(tp_run) -> None:
    _, ranks, _ = tp_run
    assert [r["drain"] for r in ranks] == [0] * TP  # gloo: nothing to wait on


def _build_at(monkeypatch: pytest.MonkeyPatch, tp: int, **sizes: int) -> None:
    import atom.models.llama as llama
    from atom.models.model_config import ModelConfig

    monkeypatch.setattr(llama, "tp_state", lambda: TPState(rank=0, world_size=tp,
                                                           backend="gloo"))
    from atom.utils.forward_context import forward_context

    cfg = ModelConfig(name="t", head_dim=16,
                      **{**{k: v for k, v in COMMON.items() if not k.endswith("token_id")},
                         **sizes})
    with forward_context(no_compile_layers={}):  # the layers register there
        llama.LlamaForCausalLM(None, cfg)


@pytest.mark.parametrize(("tp", "sizes", "message"), [
    (3, {}, r"tensor_parallel_size=3 does not divide num_attention_heads=4"),
    (4, {}, r"tensor_parallel_size=4 does not divide num_key_value_heads=2"),
    (2, {"vocab_size": 129}, r"tensor_parallel_size=2 does not divide vocab_size=129"),
    (4, {"num_key_value_heads": 4, "intermediate_size": 90},
     r"tensor_parallel_size=4 does not divide intermediate_size=90"),
])
def test_indivisible_sizes_name_the_field(monkeypatch: pytest.MonkeyPatch, tp: int,
                                          sizes: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _build_at(monkeypatch, tp, **sizes)


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 exceeds the 1 visible CUDA"):
        check_visible_devices(2, "cuda")
    check_visible_devices(2, "cpu")  # gloo ranks need no GPU


def test_model_refuses_a_tp_size_without_its_group(tmp_path) -> None:
    path = _checkpoint(str(tmp_path), "llama")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but .* 1 rank"):
        ModelRunner(_config(path, 2), load_model_config(path))


def test_compile_cache_key_and_dir_per_tp_size(monkeypatch: pytest.MonkeyPatch) -> None:
    import atom.distributed.parallel_state as ps
    from atom.compilation.cache import get_rank

    keys = {tp: Config(model="m", device="cpu", tensor_parallel_size=tp).compile_hash_factors()
            for tp in (1, 2, 4)}
    assert "tensor_parallel_size" not in keys[1]  # TP = 1 keeps today's key
    assert len({repr(k) for k in keys.values()}) == 3
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert get_rank() == 0
    monkeypatch.setattr(ps, "_STATE", TPState(rank=1, world_size=2, backend="gloo"))
    assert get_rank() == 1  # <root>/<hash>/rank_1/...


def test_every_recording_drains_the_watchdog_first() -> None:
    from cpu_recorder import CpuOpRecorder

    from atom.cudagraph.region_graph import TokenGraph

    graph = TokenGraph("t", recorder_factory=CpuOpRecorder)
    before = nccl_watchdog.drain_stats()["drains"]
    graph.record(lambda t: t * 2, [torch.ones(4, 3)], "decode")
    assert nccl_watchdog.drain_stats()["drains"] == before + 1


def test_drain_waits_every_tracked_work_to_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    """On NCCL the drain waits each eager collective until it has completed (not only until
    the stream waits on it), and forgets them afterwards."""
    class Work:
        def __init__(self, polls: int) -> None:
            self.polls, self.waited = polls, False

        def wait(self) -> bool:
            self.waited = True
            return True

        def is_completed(self) -> bool:
            self.polls -= 1
            return self.polls < 0

    monkeypatch.setattr(nccl_watchdog, "tp_state",
                        lambda: TPState(rank=0, world_size=2, backend="nccl"))
    works = [Work(0), Work(3)]
    for w in works:
        nccl_watchdog.track(w)
    assert nccl_watchdog.drain_nccl_works() == 2
    assert all(w.waited and w.polls < 0 for w in works)
    assert nccl_watchdog.pending_works() == 0 and nccl_watchdog.drain_nccl_works() == 0
