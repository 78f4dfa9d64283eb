"""Batch-1 decode step of the tiny CPU engine (level 0, float32), in CPU time per step.

The fast-path check of issue 45: the unconstrained step must not get slower than before the
penalties, logit_bias and top logprobs were added. Run it from two checkouts and compare:

    PYTHONPATH=<checkout>/runtime python bench/decode_step_cpu.py [plain|penalised|sampler]

CPU time (time.process_time) rather than wall time: the 2-core CI machine is shared, and a
single-threaded step's CPU time moves far less with the load than its wall time.
"""

from __future__ import annotations

import statistics
import sys
import time

import msgspec
import torch

from atom.config import Config
from atom.engine import LLMEngine, SamplingParams
from atom.engine.sampler import Sampler
from atom.engine.sequence import Sequence

PENALISED = dict(repetition_penalty=1.2, frequency_penalty=0.5, logit_bias={7: 2.0})


def engine_steps(params: SamplingParams, reps: int = 7, steps: int = 200) -> list[float]:
    """us of CPU per decode step, one value per rep (each a fresh request)."""
    cfg = Config(model="tiny-llama", load_format="dummy", dtype="float32", device="cpu",
                 num_kv_blocks=64, max_model_len=1024)
    engine = LLMEngine(cfg)
    engine.warmup()
    out = []
    for r in range(reps):
        p = msgspec.structs.replace(params, max_tokens=steps + 2)
        engine.add_request(f"r{r}", [1, 2, 3, 4], p)
        engine.step()  # the prefill
        engine.step()
        t0 = time.process_time()
        for _ in range(steps):
            engine.step()
        out.append((time.process_time() - t0) / steps * 1e6)
        while engine.has_unfinished_requests():
            engine.step()
    return out


def sampler_calls(reps: int = 9, calls: int = 3000) -> list[float]:
    sampler = Sampler()
    seqs = [Sequence("a", [1, 2, 3], SamplingParams(temperature=0.0))]
    logits = torch.randn(1, 256)
    out = []
    for _ in range(reps):
        t0 = time.process_time()
        for _ in range(calls):
            sampler.sample(logits, seqs)
        out.append((time.process_time() - t0) / calls * 1e6)
    return out


def main() -> None:
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "plain"
    greedy = dict(temperature=0.0, ignore_eos=True)
    if what == "sampler":
        vals = sampler_calls()
    elif what == "penalised":
        vals = engine_steps(SamplingParams(**greedy, **PENALISED))
    else:
        vals = engine_steps(SamplingParams(**greedy))
    print(f"{what}: min {min(vals):.1f} us, median {statistics.median(vals):.1f} us per call")


if __name__ == "__main__":
    main()
