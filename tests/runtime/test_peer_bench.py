"""bench/peer_bench.py: the batch sizing and roofline bytes, and its --quick CPU run end to end
(offline, decode roofline and served parts; the report names card and precision)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from peer_bench import PEERS, bytes_per_step, largest_batch  # noqa: E402


def test_largest_batch_is_what_the_kv_cache_holds() -> None:
    # 1000/1000 is 125 blocks of 16: 10,000 blocks hold 80 sequences.
    assert largest_batch(10_000, 16, 1000, 1000, 512) == 80
    assert largest_batch(10_000, 16, 128, 128, 512) == 512  # capped by max_num_seqs
    assert largest_batch(10, 16, 1000, 1000, 512) == 1  # never zero
    assert largest_batch(17, 16, 8, 9, 512) == 8  # a partial block is a whole block


def test_roofline_bytes_leave_out_an_untied_embedding() -> None:
    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(100, 8)
            self.proj = torch.nn.Linear(8, 8, bias=False)

    class Model(torch.nn.Module):
        def __init__(self, tied: bool) -> None:
            super().__init__()
            self.model, self.tie_word_embeddings = Inner(), tied

    assert bytes_per_step(Model(tied=False), 10, 7) == 8 * 8 * 4 + 70
    assert bytes_per_step(Model(tied=True), 10, 7) == (100 * 8 + 8 * 8) * 4 + 70


def test_quick_run_reports_every_part_with_card_and_precision(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"),
                                                       str(REPO / "operator")])}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "peer_bench.py"), "--quick",
                           "--port", "0", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["card"] == "cpu" and report["precision"] == "float32 weights, float32 KV"
    [offline] = report["offline"]
    assert offline["workload"] == "16/8" and offline["batch"] == 16
    assert offline["tokens"] == 16 * 8 and offline["tok_s"] > 0
    d = report["decode"]
    assert d["step_ms"] > 0 and d["roofline_ms"] > 0 and d["bytes_per_step"] > 0
    served = report["served"]
    assert [r["clients"] for r in served] == [1, 4]
    assert [r["saturation"] for r in served] == [False, True]
    for r in served:
        assert r["failed"] == 0 and r["tok_s"] > 0
        assert r["output_tokens"] == r["clients"] * 2 * 8  # two requests per client
        assert 0 < r["ttft_later_ms"]["p50"] <= r["ttft_later_ms"]["p99"]
        assert 0 < r["itl_ms"]["p50"] <= r["itl_ms"]["p99"]
    rows = report["comparison"]
    assert all(r["card"] and r["precision"] for r in rows)
    peers = [r for r in rows if r["system"] != "ours"]
    assert {r["workload"] for r in peers} == {"served saturation", "decode batch 1"}
    trt = {(p.card, p.workload, p.precision) for p in PEERS if p.system == "TensorRT-LLM 1.0"}
    assert trt == {(card, f"offline {w}", "FP8") for card in ("H100", "H200")
                   for w in ("128/128", "1000/1000", "2048/2048")}



def test_targets_follow_the_card_and_precision() -> None:
    from peer_bench import targets

    bf16 = {"card": "NVIDIA H100 80GB HBM3", "precision": "BF16 weights, BF16 KV",
            "decode": {"step_over_roofline": 1.1},
            "offline": [{"workload": "1000/1000", "tok_s": 9000.0}],
            "served": [{"clients": 64, "saturation": False, "workload": "1000/1000",
                        "tok_s": 5000.0, "ttft_later_ms": {"p50": 100.0, "p99": 350.0}},
                       {"clients": 512, "saturation": True, "workload": "1000/1000",
                        "tok_s": 8500.0, "ttft_later_ms": {"p50": 1.0, "p99": 2.0}}]}
    assert targets(bf16) == [
        "PASS: batch-1 decode step 1.10x the HBM roofline <= 1.2x",
        "PASS: served at saturation 8500 tok/s >= 1.5x vLLM's 5,333 (H100)",
        "PASS: served at saturation 8500 >= 0.9x offline 9000 tok/s",
        "FAIL: TTFT p99 at 64 clients (second and later requests) 350 ms <= 300 ms",
    ]
    fp8 = {"card": "NVIDIA H200", "precision": "FP8 weights, FP8 KV",
           "offline": [{"workload": "1000/1000", "tok_s": 14000.0}]}
    assert targets(fp8) == [
        "FAIL: FP8 offline 1000/1000 14000 tok/s >= 0.8x TensorRT-LLM's 17,744 (H200)"]
