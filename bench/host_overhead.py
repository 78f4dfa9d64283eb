"""The engine core's host work per step, on the CPU, with the model's forward stubbed
(issue 26: at 256 streams the served loop is bound by host Python, not by the GPU).

Each step of the core's busy loop is timed whole: `LLMEngine.step()` (scheduling,
`StepBatch.of`, `ModelRunner.prepare_inputs` into the host staging mirrors, the forward's
dispatch, `Sampler.sample`, prefix-cache bookkeeping, the read of the step launched before
and its outputs) and `EngineCore._route` (ReqOut per request, msgspec encoding of the
StepOutputs; the socket is a sink), plus the loop's `has_unfinished_requests` calls; wall
time and the thread's CPU time (which other processes on a busy machine do not add to).
N sequences (1, 64, 256) run greedy with logprobs and ignore_eos, as bench/serve_bench.py's
streams do. Scenarios:
- decode: N running sequences, pure decode steps. Prompts of 120..135 tokens, so about one
  sequence in 16 fills a KV block each step (served streams arrive at different times), and
  outputs long enough that none finishes while timed.
- steady: the served mix: 128-token prompts and 128 output tokens, finishing at staggered
  steps; each finished request is replaced by a new one at once (a closed-loop client), so
  at 256 about two requests end and two prompts are prefilled in a step (mixed steps).

What is as on the H200: the tiny-llama model object is built, then its forward is replaced
by a stub returning preallocated hidden states and logits ([rows, vocab]). A `GraphRunner`
in TR_HYBRID mode with the default token buckets plans and pads each step as on CUDA; its
replay returns the stub's hidden states (the graph-replay path of `run_model`; a step above
the largest bucket runs the stub "eagerly"). Asynchronous scheduling is on (placeholders,
pending-token gathers on the staged ids); prefix caching is on (block hashing).
What differs on the CPU: the staging mirrors are the device buffers themselves (no pinned
copy, no `stage_to_device` Triton launch: its placeholder gather runs as torch ops), the
sampler's argmax and the sampled-token copies are torch ops, not Triton launches, no CUDA
event is recorded or waited for, and the recorded graph's own replay (argument copies,
graph launch) is not run. Those are per-step costs, not per-sequence ones. The logits are
float32 over tiny-llama's 256 tokens; the sampler's arithmetic on them, which on the GPU is a
few launches, is reported alone as sampler_math_us (part of every step's time here).
Not timed: the API server's side, the ZeroMQ send itself (the socket is a sink) and the
decoding of AddRequest messages (steady's new requests enter at LLMEngine.add_request).

    OMP_NUM_THREADS=1 PYTHONPATH=runtime python bench/host_overhead.py [--batches 1 64 256]
        [--scenarios decode steady] [--steps 150] [--out host.json]
        [--compare REV]    # also REV's runtime/ (git archive), in alternate child runs:
                           # before/after medians from one invocation
        [--rounds 5]       # with --compare: child runs per side, alternating (the median
                           # and the best of their medians: a busy machine only adds time)
        [--cprofile 25]    # print the 25 functions with the most own time (largest batch)
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import archived_runtime, emit_report

REPO = Path(__file__).resolve().parents[1]
PROMPT_LENS = range(120, 136)
WARM_STEPS = 8
STEADY_PROMPT, STEADY_OUTPUT = 128, 128


class Sink:
    """An API server's output socket: keeps the encoded messages (hashed after the timing)."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def digest(self) -> str:
        return hashlib.sha256(b"".join(self.sent)).hexdigest()[:16]


def stub_forward(engine: Any) -> None:
    """The runner's model answers from preallocated buffers; a TR_HYBRID GraphRunner plans."""
    import torch

    from atom.config import CUDAGraphMode, default_capture_sizes
    from atom.cudagraph.runner import GraphRunner

    runner = engine.runner
    rows, cfg = runner.max_num_rows, runner.hf_config
    gen = torch.Generator().manual_seed(0)
    hidden = torch.zeros(rows, cfg.hidden_size, dtype=runner.dtype)
    logits = torch.randn(rows, cfg.vocab_size, generator=gen).to(runner.dtype)

    class StubModel(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return hidden[: input_ids.shape[0]]

        def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
            return logits[: h.shape[0]]

    buckets = [s for s in default_capture_sizes(512) if s <= runner.max_num_seqs]

    class ReplayStub(GraphRunner):
        def token_sizes(self, phase: str) -> list[int]:
            return buckets

        def maybe_replay(self, host: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
            n = int(input_ids.shape[0])
            return hidden[:n] if n in buckets else None

    runner.model = StubModel()
    runner.graph_runner = ReplayStub(
        engine.config, recorder_factory=lambda: None, mode=CUDAGraphMode.TR_HYBRID
    )


def build(num_seqs: int, max_len: int, model: str = "tiny-llama") -> tuple[Any, Any]:
    """An engine with the forward stubbed and an EngineCore around it whose one output socket
    is a Sink (model: a built-in shape or a config.json directory, dummy weights)."""
    from atom.config import Config
    from atom.engine import LLMEngine
    from atom.entrypoints.core.engine_core import CoreEndpoints, EngineCore
    from atom.entrypoints.core.messages import encoder

    blocks = num_seqs * (max_len // 16 + 2) + 16
    engine = LLMEngine(
        Config(
            model=model,
            load_format="dummy",
            dtype="float32",
            device="cpu",
            max_model_len=max_len,
            num_kv_blocks=blocks,
            max_num_seqs=256,
            seed=0,
        )
    )
    stub_forward(engine)
    # A runtime before the Unix-socket channel (request_path --compare) still takes a context.
    legacy = {"context": None} if "context" in EngineCore.__dataclass_fields__ else {}
    core = EngineCore(
        build=lambda: engine,
        endpoints=CoreEndpoints("ipc://unused-in", ["ipc://unused-out"]),
        **legacy,
    )
    core.engine = engine
    core._outs = [Sink()]
    core._enc = encoder()
    return engine, core


class Clients:
    """Requests as the API server hands them to the core (AddRequest -> add_request)."""

    def __init__(self, engine: Any, core: Any, seed: int) -> None:
        import numpy as np

        self.engine, self.core = engine, core
        self.rng = np.random.default_rng(seed)  # a prompt in a few us: the API server's work
        self.count = 0

    def add(self, prompt_len: int, max_tokens: int) -> None:
        from atom.engine import SamplingParams

        rid = f"r{self.count}"
        self.count += 1
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=True
        )
        prompt = self.rng.integers(3, self.engine.hf_config.vocab_size, prompt_len).tolist()
        self.core._owner[rid] = 0
        self.engine.add_request(rid, prompt, params)


def turn(engine: Any, core: Any, clients: Clients | None = None) -> None:
    """One busy turn of EngineCore._loop, less the socket polls; with clients, each finished
    request is replaced by a new one (added at the next turn's start, as _drain would)."""
    engine.has_unfinished_requests()
    if engine.has_unfinished_requests():
        outs = engine.step()
        core.steps += 1
        if outs:
            core._route(outs)
            if clients is not None:
                for _ in range(sum(1 for o in outs if o.finished)):
                    clients.add(STEADY_PROMPT, STEADY_OUTPUT)
    engine.has_unfinished_requests()


def start(scenario: str, num_seqs: int, steps: int) -> tuple[Any, Any, Clients | None]:
    """An engine whose next `steps` turns are the scenario's (warmed up)."""
    if scenario == "decode":
        engine, core = build(num_seqs, max(PROMPT_LENS) + WARM_STEPS + steps + 32)
        clients = Clients(engine, core, num_seqs)
        for i in range(num_seqs):
            clients.add(PROMPT_LENS[i % len(PROMPT_LENS)], engine.config.max_model_len)
        sched = engine.scheduler
        while sched.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in sched.running
        ):
            turn(engine, core)  # prefill (and mixed) steps
        for _ in range(WARM_STEPS):
            turn(engine, core)
        return engine, core, None
    engine, core = build(num_seqs, STEADY_PROMPT + STEADY_OUTPUT + 16)
    clients = Clients(engine, core, num_seqs)
    for i in range(num_seqs):  # the first wave ends at staggered steps
        clients.add(STEADY_PROMPT, max(1, STEADY_OUTPUT - i * STEADY_OUTPUT // num_seqs))
    for _ in range(STEADY_OUTPUT + 32):
        turn(engine, core, clients)
    return engine, core, clients


def measure(scenario: str, num_seqs: int, steps: int, profile_top: int = 0) -> dict[str, Any]:
    engine, core, clients = start(scenario, num_seqs, steps)
    added = clients.count if clients is not None else 0
    gc.collect()
    gc.freeze()  # as EngineCore does after warm-up
    prof = cProfile.Profile() if profile_top else None
    times, cpu = [], []
    for _ in range(steps):
        if prof is not None:
            prof.enable()
        c0 = time.thread_time()  # a system call (a few us here): outside the wall window
        t0 = time.perf_counter()
        turn(engine, core, clients)
        t1 = time.perf_counter()
        cpu.append(time.thread_time() - c0)
        times.append(t1 - t0)
        if prof is not None:
            prof.disable()
    gc.unfreeze()
    running = len(engine.scheduler.running)
    if scenario == "decode" and running != num_seqs:
        raise RuntimeError(f"{running} sequences ran, {num_seqs} wanted (a decode-only window)")
    med, med_cpu = statistics.median(times) * 1e6, statistics.median(cpu) * 1e6
    out = {
        "num_seqs": num_seqs,
        "steps": steps,
        "median_us_per_step": round(med, 1),
        "median_us_per_seq": round(med / num_seqs, 2),
        "p90_us_per_step": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e6, 1),
        "median_cpu_us_per_step": round(med_cpu, 1),
        "median_cpu_us_per_seq": round(med_cpu / num_seqs, 2),
        "bytes_sent": sum(map(len, core._outs[0].sent)),
        # every StepOutputs message sent, warm-up included: equal digests, equal outputs
        "sent_sha256": core._outs[0].digest(),
        "sampler_math_us": sampler_math_us(engine, num_seqs),
    }
    if clients is not None:
        out["requests_ended_per_step"] = round((clients.count - added) / steps, 2)
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(profile_top)
        out["cprofile"] = s.getvalue()
    return out


def sampler_math_us(engine: Any, num_seqs: int) -> float:
    """Median us of the greedy sampler's torch arithmetic on [num_seqs, vocab] logits."""
    import torch

    logits = engine.runner.model.compute_logits(torch.empty(num_seqs, 1))
    times = []
    for _ in range(50):
        t0 = time.thread_time()
        tokens = logits.argmax(dim=-1)
        logits.log_softmax(dim=-1, dtype=torch.float32).gather(-1, tokens[:, None])
        times.append(time.thread_time() - t0)
    return round(statistics.median(times) * 1e6, 1)


def run_here(args: argparse.Namespace, profile_top: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for scenario in args.scenarios:
        results[scenario] = {}
        for n in args.batches:
            top = profile_top if n == max(args.batches) else 0
            results[scenario][str(n)] = measure(scenario, n, args.steps, top)
    return results


def child(runtime: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(runtime), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--steps",
        str(args.steps),
        "--batches",
        *map(str, args.batches),
        "--scenarios",
        *args.scenarios,
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child run failed ({runtime}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """Medians of REV's runtime and this tree's, child runs alternating (same machine load)."""
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": archived_runtime(args.compare, Path(tmp)), "after": REPO / "runtime"}
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
        for _ in range(args.rounds):
            for name, path in sides.items():
                runs[name].append(child(path, args))
    table: dict[str, Any] = {}
    for scenario in args.scenarios:
        table[scenario] = {}
        for n in map(str, args.batches):
            table[scenario][n] = compare_row(
                {name: [r[scenario][n] for r in side] for name, side in runs.items()}, int(n)
            )
    return table


def compare_row(runs: dict[str, list[dict[str, Any]]], num_seqs: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for name, side in runs.items():
        row[name] = {"rounds": [r["median_us_per_step"] for r in side]}
        for key in ("us", "cpu_us"):
            rounds = [r[f"median_{key}_per_step"] for r in side]
            row[name][f"median_{key}_per_step"] = round(statistics.median(rounds), 1)
            row[name][f"median_{key}_per_seq"] = round(statistics.median(rounds) / num_seqs, 2)
            # a busy machine only adds time: the best round is the least disturbed one
            row[name][f"best_{key}_per_step"] = round(min(rounds), 1)
    for stat in ("median", "best"):
        for key in ("us", "cpu_us"):
            b = row["before"][f"{stat}_{key}_per_step"]
            row[f"cut_{stat}_{key}"] = round(1 - row["after"][f"{stat}_{key}_per_step"] / b, 3)
    digests = {r["sent_sha256"] for side in runs.values() for r in side}
    row["same_outputs"] = len(digests) == 1  # every run of both sides sent the same bytes
    return row


def git_rev(rev: str = "HEAD") -> str:
    out = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev],
        capture_output=True,
        text=True,
        check=False,
    )
    return out.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument(
        "--scenarios", nargs="+", choices=["decode", "steady"], default=["decode", "steady"]
    )
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--compare", metavar="REV", help="also time REV's runtime/ (before)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cprofile", type=int, default=0, metavar="N")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if max(args.batches) > 256:
        ap.error("at most 256 sequences (the engine's max_num_seqs here)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(run_here(args, 0)))
        return
    report: dict[str, Any] = {"bench": "host_overhead", "commit": git_rev(), "steps": args.steps}
    if args.compare:
        report["before_commit"] = git_rev(args.compare)
        report["compare"] = compare(args)
    else:
        report["results"] = run_here(args, args.cprofile)
        for per_batch in report["results"].values():
            for r in per_batch.values():
                if "cprofile" in r:
                    print(r.pop("cprofile"), file=sys.stderr)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
