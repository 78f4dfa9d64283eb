"""Every decoder layer of a batch-1 decode step in one launch (atom.kernels.triton_decode_layers)
against the launches the model runs today, on the Llama-3.2-1B shape (issue 5).

Both run the 16 layers on the same random bf16 weights, the same 512-token paged cache and the
same input row: the engine's kernels as the model calls them at one row (qkv by the preloading
kernel, the fused attention + o_proj launch, gate_up and down_proj by the tiled kernel, each
launched early), and the one-launch kernel. Checked: the residual stream out of the last layer
and the step's key and value in the cache agree (to the rounding of different summation
orders); repeated replays give the same bits (the counters re-arm). Timed: each path recorded
in a CUDA graph, median of replays, beside the layers' weight and KV bytes over the measured
copy rate.

    python bench/decode_layers_bench.py --out layers.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from atom.kernels import triton_decode_layers as fused  # noqa: E402
from atom.kernels import triton_norm_gemv as gemv_kernels  # noqa: E402
from atom.kernels.triton_attention import StepKV  # noqa: E402
from atom.kernels.triton_decode_o_proj import decode_attention_o_proj_triton  # noqa: E402
from atom.layers.rotary import Rope, RotaryEmbedding  # noqa: E402
from atom.models.registry import load_model_config  # noqa: E402
from decode_bench import MODEL, copy_rate_bytes_per_s  # noqa: E402


def build(context: int, block_size: int = 16, table_tokens: int = 1568, seed: int = 0):
    cfg = load_model_config(MODEL)
    torch.manual_seed(seed)
    L, H, inter = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
    hd, nh, kvh = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q_size, kv_size = nh * hd, kvh * hd
    dev, dt = "cuda", torch.bfloat16

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    weights = fused.DecodeLayerWeights(
        qkv=rand(L, q_size + 2 * kv_size, H), o=rand(L, H, q_size),
        gate_up=rand(L, 2 * inter, H), down=rand(L, H, inter),
        input_norm=(1 + rand(L, H, scale=0.1)), post_norm=(1 + rand(L, H, scale=0.1)))
    blocks_per_seq = table_tokens // block_size
    num_blocks = blocks_per_seq + 8
    kv = rand(2, L, num_blocks, block_size, kvh, hd, scale=1.0)
    table = torch.randperm(num_blocks - 1, device=dev)[:blocks_per_seq].to(torch.int32) + 1
    block_tables = table.view(1, -1).contiguous()
    pos = context  # this step's token follows `context` cached ones
    slot = table[pos // block_size].to(torch.int64) * block_size + pos % block_size
    meta = dict(context_lens=torch.tensor([context + 1], dtype=torch.int32, device=dev),
                block_tables=block_tables, slot_mapping=slot.view(1))
    rotary = RotaryEmbedding(hd, table_tokens, cfg.rope_theta, cfg.rope_scaling).to(dev)
    rope = Rope(torch.tensor([pos], dtype=torch.int64, device=dev), rotary.cos_cache,
                rotary.sin_cache)
    h0 = rand(1, H, scale=1.0)
    return cfg, weights, kv, meta, rope, h0


def engine_layers(cfg, w, kv, meta, rope, h0) -> torch.Tensor:
    """The 16 layers by the launches the model makes at one row (LlamaDecoderLayer.forward)."""
    q_size = cfg.num_attention_heads * cfg.head_dim
    kv_size = cfg.num_key_value_heads * cfg.head_dim
    eps = cfg.rms_norm_eps
    h = h0
    for layer in range(w.qkv.shape[0]):
        qkv = gemv_kernels.gemv(h, w.qkv[layer], None, norm_weight=w.input_norm[layer], eps=eps,
                                overlap=True)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        out = torch.empty(1, q_size, dtype=h.dtype, device=h.device)
        mid = torch.empty_like(h)
        decode_attention_o_proj_triton(
            q, kv[0, layer], kv[1, layer], out, meta["context_lens"], meta["block_tables"],
            cfg.head_dim ** -0.5, cfg.num_attention_heads, w.o[layer], None, h, mid, rope=rope,
            new_kv=StepKV(k, v, meta["slot_mapping"]), overlap=True)
        act = gemv_kernels.gemv(mid, w.gate_up[layer], None, norm_weight=w.post_norm[layer],
                                eps=eps, gated=True, overlap=True)
        h = gemv_kernels.gemv(act, w.down[layer], None, residual=mid, overlap=True)
    return h


def one_launch(cfg, w, kv, meta, rope, h0, hs: torch.Tensor) -> torch.Tensor:
    hs[0].copy_(h0[0])
    return fused.decode_layers(hs, w, kv[0], kv[1], meta["context_lens"], meta["block_tables"],
                               meta["slot_mapping"], rope, cfg.head_dim ** -0.5,
                               cfg.rms_norm_eps, cfg.num_attention_heads)


def time_graph(fn, replays: int) -> float:
    """Median us of a replay of fn recorded in a CUDA graph."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--replays", type=int, default=200)
    args = ap.parse_args()
    cfg, w, kv, meta, rope, h0 = build(args.context)
    assert fused.decode_layers_applies(h0, w), "the one-launch kernel does not take this shape"
    layers = w.qkv.shape[0]
    hs = torch.empty(layers + 1, cfg.hidden_size, dtype=h0.dtype, device=h0.device)
    slot = int(meta["slot_mapping"][0])
    bs = kv.shape[3]

    kv_ref = kv.clone()
    ref = engine_layers(cfg, w, kv_ref, meta, rope, h0)
    kv_one = kv.clone()
    out = one_launch(cfg, w, kv_one, meta, rope, h0, hs).clone()
    torch.cuda.synchronize()
    again = one_launch(cfg, w, kv_one, meta, rope, h0, hs).clone()
    step_ref = kv_ref[:, :, slot // bs, slot % bs].float()
    step_one = kv_one[:, :, slot // bs, slot % bs].float()
    diff = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    kv_diff = (step_one - step_ref).abs().max().item()
    untouched = torch.equal(torch.cat([kv_one[:, :, : slot // bs].flatten(),
                                       kv_one[:, :, slot // bs + 1:].flatten()]),
                            torch.cat([kv_ref[:, :, : slot // bs].flatten(),
                                       kv_ref[:, :, slot // bs + 1:].flatten()]))
    check = {"max_abs_diff": diff, "ref_max_abs": scale, "kv_step_max_abs_diff": kv_diff,
             "repeat_bit_identical": bool(torch.equal(out, again)),
             "other_cache_blocks_identical": bool(untouched)}
    print("check:", check, flush=True)
    assert check["repeat_bit_identical"] and check["other_cache_blocks_identical"], check
    assert diff <= 0.02 * scale and kv_diff <= 0.05, check

    rate = copy_rate_bytes_per_s()
    layer_bytes = sum(t[0].numel() * t.element_size() for t in (w.qkv, w.o, w.gate_up, w.down))
    kv_bytes = 2 * cfg.num_key_value_heads * cfg.head_dim * 2 * (args.context + 1)
    bound_us = layers * (layer_bytes + kv_bytes) / rate * 1e6
    t_engine = time_graph(lambda: engine_layers(cfg, w, kv, meta, rope, h0), args.replays)
    t_one = time_graph(lambda: one_launch(cfg, w, kv, meta, rope, h0, hs), args.replays)
    t_engine2 = time_graph(lambda: engine_layers(cfg, w, kv, meta, rope, h0), args.replays)
    result = {"device": torch.cuda.get_device_name(), "context": args.context,
              "layers": layers, "copy_rate_tb_s": round(rate / 1e12, 3),
              "bound_us": round(bound_us, 1), "engine_us": [round(t_engine, 1),
                                                            round(t_engine2, 1)],
              "one_launch_us": round(t_one, 1), "check": check,
              "settings": {k: getattr(fused, k) for k in (
                  "PROGRAMS", "WARPS", "QKV_K", "QKV_SPLIT", "QKV_STAGES", "GATE_UP_K",
                  "GATE_UP_STAGES", "DOWN_K", "DOWN_SPLIT", "DOWN_STAGES")}}
    print(json.dumps(result, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
