"""FP8 pieces on the CPU (issue 47): weight and activation quantization error bounds, the
reference FP8 GEMM, the FP8 KV cache in the torch attention path, the FP8 ops' fake shapes,
and the flags' path into Config and the compile-cache key."""

from __future__ import annotations

import pytest
import torch

from atom.config import Config
from atom.kernels.paged_attention_torch import paged_attention_torch, write_kv_torch
from atom.kernels.testing import random_paged_batch
from atom.quantization.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize,
    fp8_linear,
    quantize_rows,
    quantize_weight,
    scaled_mm_supported,
)
from atom.quantization.kv_cache import kv_cache_dtype


def test_row_quantization_error_is_e4m3s_rounding() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 2, 64)[:, None]
    x[3] = 0.0  # a zero row: a tiny scale, zeros back, no NaN
    q, scale = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (64, 1)
    assert q.float().abs().max() <= FP8_MAX
    back = dequantize(q, scale)
    # 3 mantissa bits: half a step is 2^-4 of the value; below the normal range (2^-6) a
    # subnormal step of 2^-9 (times the row's scale)
    bound = x.abs() * 2.0 ** -4 + scale * 2.0 ** -10
    assert ((back - x).abs() <= bound + 1e-12).all()
    assert torch.equal(back[3], torch.zeros(256))
    w = torch.randn(48, 32, generator=g)
    wq, ws = quantize_weight(w)
    assert ws.shape == (48,) and torch.equal(dequantize(wq, ws), dequantize(*quantize_rows(w)))


def test_reference_gemm_is_the_dequantized_product() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 64, generator=g), torch.randn(48, 64, generator=g), torch.randn(48)
    wq, ws = quantize_weight(w)
    xq, xs = quantize_rows(x)
    assert not scaled_mm_supported(x, wq)  # the CPU takes the reference path
    want = dequantize(xq, xs) @ dequantize(wq, ws).t() + b
    torch.testing.assert_close(fp8_linear(x, wq, ws, b), want)
    out = fp8_linear(x.bfloat16(), wq, ws, None)
    assert out.dtype == torch.bfloat16
    assert (out.float() - x @ w.t()).norm() / (x @ w.t()).norm() < 0.06


def test_fp8_ops_fake_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    import atom.quantization.fp8_layers  # noqa: F401 - registers the ops

    with FakeTensorMode():
        x, n = torch.empty(7, 64), torch.ones(64)
        w, s = torch.empty(96, 64, dtype=FP8_DTYPE), torch.ones(96)
        assert torch.ops.aiter.fp8_norm_linear(x, n, 1e-6, w, s, None, True).shape == (7, 48)
        assert torch.ops.aiter.fp8_linear_add(x, w, s, None, None).shape == (7, 96)


def test_fp8_kv_cache_in_the_torch_path() -> None:
    """Keys and values stored as FP8, read back widened: attention over them is the fp32
    cache's within FP8's rounding; values past FP8's range are clamped, never NaN."""
    b = random_paged_batch(q_lens=[9, 1, 4], ctx_lens=[9, 30, 20], num_heads=4, num_kv_heads=2,
                           head_dim=16, pad_rows=2, pad_seqs=1, seed=5)
    outs, caches = [], []
    for dtype in (torch.float32, FP8_DTYPE):
        kc, vc = b.k_cache.to(dtype), b.v_cache.to(dtype)
        write_kv_torch(b.k, b.v, kc, vc, b.slot_mapping)
        out = torch.empty_like(b.q)
        paged_attention_torch(b.q, kc, vc, out, b.cu_seqlens_q, b.context_lens, b.block_tables,
                              0.25, 4)
        outs.append(out)
        caches.append(kc)
    keep = b.slot_mapping[: b.num_rows]
    stored = caches[1].view(-1, 2, 16)[keep].float()
    want = b.k[: b.num_rows].reshape(-1, 2, 16)
    assert ((stored - want).abs() <= want.abs() * 2.0 ** -4 + 2.0 ** -10).all()
    torch.testing.assert_close(outs[1][: b.num_rows], outs[0][: b.num_rows], atol=0.1, rtol=0.05)
    # past the range: clamped to +-448
    kc = b.k_cache.to(FP8_DTYPE)
    write_kv_torch(b.k * 1e4, b.v, kc, b.v_cache.to(FP8_DTYPE), b.slot_mapping)
    assert torch.isfinite(kc.float()).all() and kc.float().abs().max() == FP8_MAX


def test_flags_reach_config_and_the_compile_key() -> None:
    from atom.cli.args import build_parser
    from atom.cli.config import config_from_args

    argv = ["serve", "--model", "tiny-llama", "--device", "cpu"]
    cfg = config_from_args(build_parser().parse_args(
        [*argv, "--quantization", "fp8", "--kv-cache-dtype", "fp8"]))
    assert (cfg.quantization, cfg.kv_cache_dtype) == ("fp8", "fp8")
    base = config_from_args(build_parser().parse_args(argv)).compile_hash_factors()
    assert "quantization" not in base and "kv_cache_dtype" not in base  # keys kept
    assert cfg.compile_hash_factors() == {**base, "quantization": "fp8", "kv_cache_dtype": "fp8"}
    with pytest.raises(ValueError, match="quantization"):
        Config(model="tiny-llama", device="cpu", quantization="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Config(model="tiny-llama", device="cpu", kv_cache_dtype="fp16")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--quantization", "int4"])
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8", torch.bfloat16) == FP8_DTYPE


def test_fp8_engine_quantizes_at_load_and_halves_the_cache() -> None:
    """An engine built with both flags: FP8 projections filled from the loaded weights (the
    bf16 ones freed), a float8 cache twice the blocks per byte, greedy tokens produced."""
    from atom.engine import LLMEngine, SamplingParams

    def engine(**kw: object) -> LLMEngine:
        return LLMEngine(Config(model="tiny-llama", load_format="dummy", dtype="bfloat16",
                                device="cpu", num_kv_blocks=32, max_model_len=256, **kw))

    plain, fp8 = engine(), engine(quantization="fp8", kv_cache_dtype="fp8")
    layer = fp8.runner.model.model.decoder_layers()[0]
    assert layer.fp8 is not None and layer.fp8.qkv.weight.dtype == FP8_DTYPE
    assert layer.self_attn.qkv_proj.weight.numel() == 0
    assert fp8.runner.kv_cache.dtype == FP8_DTYPE
    assert fp8.runner.kv_block_bytes() * 2 == plain.runner.kv_block_bytes()
    assert fp8.runner.model.num_params() == plain.runner.model.num_params()
    ref = plain.runner.model.model.decoder_layers()[0].self_attn.qkv_proj.weight
    assert torch.equal(layer.fp8.qkv.weight, quantize_weight(ref.data)[0])  # same draw
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 17, 33, 5, 90, 12, 7], [1, 100, 3]]
    out = fp8.generate(prompts, params)
    assert [len(t) for t in out] == [6, 6]
    assert out[0][:3] == plain.generate(prompts, params)[0][:3]


def test_fp8_kv_blocks_travel_between_instances() -> None:
    """P/D: an FP8 cache's layout names its dtype (1 byte an element), and its blocks gather
    and scatter byte for byte."""
    from atom.disagg.kv_blocks import (
        as_bytes,
        engine_layout,
        gather_blocks,
        new_staging,
        scatter_blocks,
    )
    from atom.engine import LLMEngine

    engine = LLMEngine(Config(model="tiny-llama", load_format="dummy", dtype="bfloat16",
                              device="cpu", num_kv_blocks=32, max_model_len=256,
                              kv_cache_dtype="fp8"))
    layout = engine_layout(engine)
    assert layout.dtype == "float8_e4m3fn" and layout.element_bytes == 1
    src = engine.runner.kv_cache
    src.view(torch.uint8).copy_(torch.randint(0, 120, src.shape, dtype=torch.uint8))
    blocks = gather_blocks(src, [3, 4, 9])
    staged = new_staging(layout, 3)
    bytes(as_bytes(staged))  # a flat byte view, as the TCP transport sends
    staged.copy_(blocks)
    dst = torch.zeros_like(src)
    scatter_blocks(dst, [0, 1, 2], staged)
    assert torch.equal(dst[:, :, :3].view(torch.uint8), src[:, :, [3, 4, 9]].view(torch.uint8))
