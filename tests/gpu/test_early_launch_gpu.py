"""Launches that start before the kernel before them ends (programmatic dependent launch), bf16
on CUDA: the batch-1 chain of a Llama-3.2-1B layer as the model runs it (down_proj's tiled
GEMV, the preloading qkv kernel, decode attention with o_proj), each reading what the launch
just before it wrote, against the same kernels launched one after another: bit-identical,
eagerly and replayed from a CUDA graph with new inputs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (Triton kernels)"),
]

HEADS, KV_HEADS, DIM, HIDDEN, FFN = 32, 8, 64, 2048, 8192
Q, KV = HEADS * DIM, KV_HEADS * DIM


def _early_launch_available() -> None:
    from atom.kernels.launch import programmatic_launch

    if not programmatic_launch(torch.device("cuda")):
        pytest.skip("needs sm_90 or later (programmatic dependent launch)")


class Layer:
    """Weights and step buffers for one decode row; chain(early) runs down_proj -> qkv ->
    attention + o_proj into self.proj."""

    def __init__(self, seed: int, ctx: int) -> None:
        from atom.kernels.testing import random_paged_batch

        gen = torch.Generator(device="cuda").manual_seed(seed)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

        self.batch = random_paged_batch([1], [ctx], HEADS, KV_HEADS, DIM, num_blocks=512,
                                        max_blocks=256, dtype=torch.bfloat16, device="cuda",
                                        seed=seed)
        self.w_down, self.w_qkv = randn(HIDDEN, FFN, scale=FFN ** -0.5), randn(Q + 2 * KV, HIDDEN,
                                                                               scale=HIDDEN ** -0.5)
        self.w_o, self.norm_w = randn(HIDDEN, Q, scale=Q ** -0.5), 1 + randn(HIDDEN, scale=0.1)
        self.act, self.res = randn(1, FFN), randn(1, HIDDEN)
        self.hidden, self.qkv = torch.empty_like(self.res), torch.empty(1, Q + 2 * KV,
                                                                        dtype=torch.bfloat16,
                                                                        device="cuda")
        self.out = torch.empty(1, Q, dtype=torch.bfloat16, device="cuda")
        self.proj = torch.empty_like(self.res)

    def chain(self, early: bool) -> None:
        from atom.kernels import triton_attention as tk
        from atom.kernels import triton_decode_o_proj as fused
        from atom.kernels import triton_norm_gemv as gemvs

        b = self.batch
        gemvs.gemv(self.act, self.w_down, None, residual=self.res, out=self.hidden, overlap=early)
        if early:  # as the model asks: the preloading kernel, launched early
            gemvs.gemv(self.hidden, self.w_qkv, None, norm_weight=self.norm_w, eps=1e-5,
                       out=self.qkv, overlap=True)
        else:  # the same kernel as an ordinary launch
            gemvs.row_gemv(self.hidden, self.w_qkv, None, self.qkv, norm_weight=self.norm_w,
                           eps=1e-5)
        q, k, v = self.qkv.split([Q, KV, KV], dim=-1)
        fused.decode_attention_o_proj_triton(
            q, b.k_cache, b.v_cache, self.out, b.context_lens, b.block_tables, DIM ** -0.5, HEADS,
            self.w_o, None, self.hidden, self.proj, new_kv=tk.StepKV(k, v, b.slot_mapping),
            overlap=early)

    def snapshot(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.hidden, self.qkv, self.out, self.proj,
                                    self.batch.k_cache, self.batch.v_cache)]

    def new_step(self, seed: int, ctx: int) -> None:
        """New inputs in the same buffers, written by kernels just before the chain."""
        other = Layer(seed, ctx)
        self.act.copy_(other.act)
        self.res.copy_(other.res)
        for name in ("slot_mapping", "context_lens", "block_tables", "k_cache", "v_cache"):
            getattr(self.batch, name).copy_(getattr(other.batch, name))


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the launches made early (the row kernel and the attention with PDL)."""
    from atom.kernels import triton_attention as tk
    from atom.kernels import triton_decode_o_proj as fused
    from atom.kernels import triton_norm_gemv as gemvs

    seen: list[str] = []
    row_gemv, decode_launch = gemvs.row_gemv, tk.decode_launch

    def spy_row(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("pdl"):
            seen.append("qkv")
        return row_gemv(*args, **kwargs)

    def spy_launch(*args: object, **kwargs: object) -> tk.DecodeLaunch:
        launch = decode_launch(*args, **kwargs)
        if launch.constants["PDL"]:
            seen.append("attention")
        return launch

    monkeypatch.setattr(gemvs, "row_gemv", spy_row)
    monkeypatch.setattr(fused, "decode_launch", spy_launch)
    return seen


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    names = ("hidden", "qkv", "attention", "o_proj + residual", "k_cache", "v_cache")
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(a, b), f"{name} differs with early launches"


@pytest.mark.parametrize("ctx", [1, 300, 4096])
def test_early_chain_equals_ordinary_launches(ctx: int, monkeypatch: pytest.MonkeyPatch) -> None:
    _early_launch_available()
    seen = _spy(monkeypatch)
    ordinary, early = Layer(ctx, ctx), Layer(ctx, ctx)
    ordinary.chain(early=False)
    early.chain(early=True)
    torch.cuda.synchronize()
    assert seen == ["qkv", "attention"]
    _assert_equal(early.snapshot(), ordinary.snapshot())


def test_early_chain_replays_from_a_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded once; each replay follows the copies that write its inputs and matches the
    ordinary launches on the same inputs."""
    _early_launch_available()
    seen = _spy(monkeypatch)
    layer, ordinary = Layer(1, 40), Layer(1, 40)
    layer.chain(early=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer.chain(early=True)
    assert seen.count("qkv") == 2 and seen.count("attention") == 2
    for i, ctx in enumerate([700, 1, 4000, 65]):
        layer.new_step(20 + i, ctx)
        ordinary.new_step(20 + i, ctx)
        graph.replay()
        first = layer.snapshot()
        ordinary.chain(early=False)
        torch.cuda.synchronize()
        _assert_equal(first, ordinary.snapshot())


class MlpChain:
    """Eight decode rows through o_proj + residual -> gate_up (norm, SiLU gate) -> down_proj +
    residual -> qkv (norm): the tiled launches the model makes at batch 8, each reading the
    output of the launch just before it."""

    ROWS = 8

    def __init__(self, seed: int) -> None:
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()

        self.w_o, self.w_gate_up = randn(HIDDEN, Q, scale=Q ** -0.5), randn(2 * FFN, HIDDEN,
                                                                            scale=HIDDEN ** -0.5)
        self.w_down, self.w_qkv = randn(HIDDEN, FFN, scale=FFN ** -0.5), randn(Q + 2 * KV, HIDDEN,
                                                                               scale=HIDDEN ** -0.5)
        self.norm1, self.norm2 = 1 + randn(HIDDEN, scale=0.1), 1 + randn(HIDDEN, scale=0.1)
        self.attn, self.res = randn(self.ROWS, Q), randn(self.ROWS, HIDDEN)
        self.hidden = torch.empty_like(self.res)
        self.act = torch.empty(self.ROWS, FFN, dtype=torch.bfloat16, device="cuda")
        self.hidden2 = torch.empty_like(self.res)
        self.qkv = torch.empty(self.ROWS, Q + 2 * KV, dtype=torch.bfloat16, device="cuda")

    def chain(self, early: bool) -> None:
        from atom.kernels.triton_norm_gemv import gemv

        gemv(self.attn, self.w_o, None, residual=self.res, out=self.hidden, overlap=early)
        gemv(self.hidden, self.w_gate_up, None, norm_weight=self.norm1, eps=1e-5, gated=True,
             out=self.act, overlap=early)
        gemv(self.act, self.w_down, None, residual=self.hidden, out=self.hidden2, overlap=early)
        gemv(self.hidden2, self.w_qkv, None, norm_weight=self.norm2, eps=1e-5, out=self.qkv,
             overlap=early)

    def outputs(self) -> list[torch.Tensor]:
        return [t.clone() for t in (self.hidden, self.act, self.hidden2, self.qkv)]


def _spy_tiled(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each tiled launch was made early."""
    from atom.kernels import triton_norm_gemv as gemvs

    seen: list[bool] = []
    plan = gemvs.tiled_plan

    def spy(*args: object) -> gemvs.TiledPlan:
        made = plan(*args)
        seen.append(made.early)
        return made

    monkeypatch.setattr(gemvs, "tiled_plan", spy)
    return seen


def test_eight_row_early_tiled_chain_equals_ordinary_launches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Early (single-wave, spread) launches at 8 rows give the ordinary launches' bits, eagerly
    and replayed from a CUDA graph after copies that rewrite the first input."""
    _early_launch_available()
    from atom.kernels.launch import sm_resources

    if sm_resources(torch.device("cuda"))[0] < 128:
        pytest.skip("o_proj's 128 programs are one wave only on a GPU of 128 SMs or more")
    seen = _spy_tiled(monkeypatch)
    early, ordinary = MlpChain(3), MlpChain(3)
    early.chain(early=True)
    ordinary.chain(early=False)
    torch.cuda.synchronize()
    assert seen == [True] * 4 + [False] * 4
    names = ("o_proj + residual", "gate_up", "down_proj + residual", "qkv")
    for name, a, b in zip(names, early.outputs(), ordinary.outputs(), strict=True):
        assert torch.equal(a, b), f"{name} differs with early launches"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        early.chain(early=True)
    for seed in (4, 5):
        fresh = MlpChain(seed)
        early.attn.copy_(fresh.attn)
        early.res.copy_(fresh.res)
        ordinary.attn.copy_(fresh.attn)
        ordinary.res.copy_(fresh.res)
        graph.replay()
        ordinary.chain(early=False)
        torch.cuda.synchronize()
        for name, a, b in zip(names, early.outputs(), ordinary.outputs(), strict=True):
            assert torch.equal(a, b), f"{name} differs on replay (seed {seed})"
