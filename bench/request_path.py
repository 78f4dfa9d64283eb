"""One request's host path to its first token, stage by stage, on the CPU (issue 29: a fully
cached 4,096-token prompt still had 11.8 ms TTFT on the H200, a 128-token one 7.2 ms for ~1 ms
of GPU prefill).

Every stage runs the real code, in the order a served request meets it:
- API in: the body's JSON (atom.wire.body.loads_object), validation and tokenization
  (protocol.completion_request with a text prompt; the byte-level tokenizer the built-in and
  dummy shapes use), SamplingParams and the AddRequest's msgpack encoding (CoreClient's work
  less the socket).
- core: the AddRequest's decoding, EngineCore._add_now (LLMEngine.add_request), then the
  loop's turns until a StepOutputs names the request: the scheduler's admission (its prefix-cache
  lookup, block hashing included, is shown alone), the runner's input preparation, the stubbed
  forward, the sampler, prefix-cache registration, the read of the launched step, and
  EngineCore._route (ReqOut, StepOutputs encoding; the socket is a sink).
- API out: the StepOutputs' decoding and RequestStream.push, detokenization and stop strings
  (as generation.generate does), the first SSE chunk (with logprobs) and, for a non-streamed
  request, the whole JSON body (reported, not summed: a request has one or the other).
The forward is bench/host_overhead.py's stub (preallocated logits, a TR_HYBRID GraphRunner
planning buckets), on tiny-llama's shape with 8,192 positions (bench/common.long_tiny_llama).
Prompts of 128, 1,024 and 4,096 tokens; "first": a new prompt each time (nothing cached),
"cached": the same prompt again (every full block but the last token's is a hit). Medians over
--repeats requests of wall time and thread CPU time (time.thread_time: what other processes on a
busy machine do not add to).

--e2e also serves the same model for real (`atom-runtime serve`, level 0, real tiny forward) and
times max_tokens=1 requests over a kept-alive HTTP connection; the engine's own time for the
same request (its steps with the real forward, in this process) is subtracted, which leaves
what the API server, ZeroMQ and the event loops add.

    OMP_NUM_THREADS=1 PYTHONPATH=runtime:bench python bench/request_path.py [--lens 128 1024 4096]
        [--repeats 30] [--e2e] [--compare REV [--rounds 3]] [--out path.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import REPO, archived_runtime, emit_report, git_commit, long_tiny_llama

MAX_LEN = 8192
NUM_KV_BLOCKS = 4 * MAX_LEN // 16  # room for the cached prompt and the first ones beside it
SERVED = "bench"
# Stages in path order; the step's parts are timed inside LLMEngine.step (wrappers).
API_IN = ("parse_json", "validate_tokenize", "params_encode")
CORE = ("decode_add", "add_request", "schedule", "prefix_lookup", "prepare_inputs",
        "forward_stub", "sampler", "cache_blocks", "read_step", "step_other", "route")  # fmt: skip
API_OUT = ("decode_outputs", "detokenize", "first_sse_chunk")
NOT_SUMMED = ("json_body",)  # a non-streamed request's body instead of the SSE chunk


@dataclass
class Clock:
    """Wall and thread-CPU microseconds per stage, for the request being timed."""

    wall: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, wall: float, cpu: float) -> None:
        self.wall[name] = self.wall.get(name, 0.0) + wall * 1e6
        self.cpu[name] = self.cpu.get(name, 0.0) + cpu * 1e6

    def run(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        c0, t0 = time.thread_time(), time.perf_counter()
        out = fn(*args)
        self.add(name, time.perf_counter() - t0, time.thread_time() - c0)
        return out


def wrap(obj: Any, attr: str, name: str, clock: Callable[[], Clock]) -> None:
    """obj.attr timed under `name` into the clock of the request being timed (an instance
    attribute over the method)."""
    fn = getattr(obj, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        return clock().run(name, lambda: fn(*args, **kwargs))

    setattr(obj, attr, timed)


class RequestPath:
    """An engine core (forward stubbed) and the API server's pieces around it."""

    def __init__(self, model_dir: Path, real_forward: bool = False) -> None:
        from atom.entrypoints.core.messages import input_decoder, output_decoder
        from atom.tokenizer import load_tokenizer
        from host_overhead import build

        if real_forward:
            from atom.engine import LLMEngine
            from atom.entrypoints.core.engine_core import CoreEndpoints, EngineCore
            from atom.entrypoints.core.messages import encoder
            from host_overhead import Sink

            engine = LLMEngine(_config(model_dir))
            core = EngineCore(build=lambda: engine, endpoints=CoreEndpoints("ipc://unused", []))
            core.engine, core._outs, core._enc = engine, [Sink()], encoder()
        else:
            engine, core = build(1, MAX_LEN, model=str(model_dir))
        self.engine, self.core = engine, core
        hf = engine.hf_config
        self.tok = load_tokenizer(str(model_dir), hf.vocab_size, hf.bos_token_id, hf.eos_token_id)
        self.in_dec, self.out_dec = input_decoder(), output_decoder()
        self.clock = Clock()
        self.count = 0
        c, bm, runner = (lambda: self.clock), engine.block_manager, engine.runner
        wrap(engine.scheduler, "schedule", "schedule", c)
        wrap(bm, "match_prefix", "prefix_lookup", c)
        wrap(runner, "prepare_inputs", "prepare_inputs", c)
        wrap(runner, "run_model", "forward_stub", c)
        wrap(engine.sampler, "sample", "sampler", c)
        wrap(bm, "cache_blocks_of", "cache_blocks", c)
        wrap(engine, "_read", "read_step", c)

    def body(self, text: str, stream: bool = True) -> dict[str, Any]:
        return {"model": SERVED, "prompt": text, "max_tokens": 16, "logprobs": 1,
                "ignore_eos": True, "temperature": 0.0, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}  # fmt: skip

    def request(self, text: str) -> Clock:
        """One request to its first token, every stage timed; then ended (untimed)."""
        import orjson

        from atom.entrypoints.core import messages as msgs
        from atom.entrypoints.core.stream import RequestStream
        from atom.entrypoints.generation import Delta
        from atom.entrypoints.openai_format import OpenAIFormatter, dumps, sse
        from atom.entrypoints.protocol import completion_request
        from atom.tokenizer import IncrementalDetokenizer, StopStringChecker
        from atom.wire.body import loads_object

        clock = self.clock = Clock()
        rid = f"cmpl-{self.count}"
        self.count += 1
        raw = orjson.dumps(self.body(text))
        # ---- API in
        body = clock.run("parse_json", loads_object, raw)
        vocab = self.engine.hf_config.vocab_size
        req = clock.run("validate_tokenize", completion_request, body, self.tok, SERVED,
                        MAX_LEN, vocab)  # fmt: skip

        def params_encode() -> bytes:
            return self.core._enc.encode(msgs.AddRequest(rid, 0, req.prompt_ids, req.params))

        data = clock.run("params_encode", params_encode)
        # ---- core
        msg = clock.run("decode_add", self.in_dec.decode, data)
        clock.run("add_request", self.core._add, msg)
        engine, sink = self.engine, self.core._outs[0]
        sent = len(sink.sent)
        while len(sink.sent) == sent:
            before = dict(clock.wall), dict(clock.cpu)
            c0, t0 = time.thread_time(), time.perf_counter()
            outs = engine.step()
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            self.core.steps += 1
            # the step's own remainder: what its timed parts leave
            inner_w = sum(clock.wall.get(k, 0) - before[0].get(k, 0) for k in clock.wall)
            inner_c = sum(clock.cpu.get(k, 0) - before[1].get(k, 0) for k in clock.cpu)
            # prefix_lookup runs inside schedule: counted there, not twice
            inner_w -= clock.wall.get("prefix_lookup", 0) - before[0].get("prefix_lookup", 0)
            inner_c -= clock.cpu.get("prefix_lookup", 0) - before[1].get("prefix_lookup", 0)
            inner_w -= clock.wall.get("forward_stub", 0) - before[0].get("forward_stub", 0)
            inner_c -= clock.cpu.get("forward_stub", 0) - before[1].get("forward_stub", 0)
            clock.add("step_other", wall - inner_w / 1e6, cpu - inner_c / 1e6)
            clock.wall["steps_to_first_token"] = clock.wall.get("steps_to_first_token", 0) + 1
            if outs:
                clock.run("route", self.core._route, outs)
        # ---- API out
        stream = RequestStream(rid)

        def decode_push() -> msgs.ReqOut:
            out = self.out_dec.decode(sink.sent[-1])
            for o in out.outputs:
                stream.push(o, time.monotonic())
            return out.outputs[0]

        out = clock.run("decode_outputs", decode_push)
        detok, stops = IncrementalDetokenizer(self.tok), StopStringChecker(req.stop)

        def detokenize() -> Delta:
            text, _ = stops.feed(detok.add(out.tokens))
            return Delta(text=text, token_ids=out.tokens, logprobs=out.logprobs,
                         prompt_tokens=out.num_prompt_tokens, completion_tokens=len(out.tokens),
                         cached_tokens=out.num_cached_tokens)  # fmt: skip

        delta = clock.run("detokenize", detokenize)
        fmt = OpenAIFormatter(self.tok, rid, req, chat=False)
        clock.run("first_sse_chunk", lambda: sse(fmt.chunk(delta)))
        clock.run("json_body", lambda: dumps(fmt.full([delta])))
        clock.wall["cached_tokens"] = out.num_cached_tokens
        # ---- end it (untimed), as the handler's abort would
        engine.abort_request(rid)
        self.core._owner.pop(rid, None)
        while engine.has_unfinished_requests():
            engine.step()
        return clock


def _config(model_dir: Path) -> Any:
    from atom.config import Config

    return Config(model=str(model_dir), load_format="dummy", dtype="float32", device="cpu",
                  max_model_len=MAX_LEN, num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8,
                  seed=0, compilation_config={"level": 0})  # fmt: skip


def prompt_text(rng: random.Random, num_tokens: int) -> str:
    """A text of num_tokens - 1 bytes: the byte-level tokenizer adds BOS."""
    return "".join(rng.choices(string.ascii_letters + " ", k=num_tokens - 1))


def measure(model_dir: Path, lens: list[int], repeats: int) -> dict[str, Any]:
    """{len: {first|cached: {stage: {us, cpu_us}}}}, medians over `repeats` requests."""
    import gc

    path = RequestPath(model_dir)
    rng = random.Random(0)
    for _ in range(3):  # warm-up: first calls (imports, numpy paths) are not the path's cost
        path.request(prompt_text(rng, 64))
    gc.collect()
    gc.freeze()
    results: dict[str, Any] = {}
    for n in lens:
        same = prompt_text(rng, n)
        path.request(same)  # the cached prompt's first run
        runs: dict[str, list[Clock]] = {"first": [], "cached": []}
        for _ in range(repeats):  # alternating, so both see the same machine load
            runs["first"].append(path.request(prompt_text(rng, n)))
            runs["cached"].append(path.request(same))
        results[str(n)] = {mode: summarize(clocks) for mode, clocks in runs.items()}
    gc.unfreeze()
    return results


def summarize(clocks: list[Clock]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stage in (*API_IN, *CORE, *API_OUT, *NOT_SUMMED):
        out[stage] = {
            "us": round(statistics.median(c.wall.get(stage, 0.0) for c in clocks), 1),
            "cpu_us": round(statistics.median(c.cpu.get(stage, 0.0) for c in clocks), 1),
        }
    summed = [s for s in (*API_IN, *CORE, *API_OUT) if s != "prefix_lookup"]
    out["total"] = {
        "us": round(statistics.median(sum(c.wall.get(s, 0) for s in summed) for c in clocks), 1),
        "cpu_us": round(statistics.median(sum(c.cpu.get(s, 0) for s in summed) for c in clocks), 1),
    }
    out["steps_to_first_token"] = statistics.median(c.wall["steps_to_first_token"] for c in clocks)
    out["cached_tokens"] = statistics.median(c.wall["cached_tokens"] for c in clocks)
    return out


def table(results: dict[str, Any], lens: list[int]) -> str:
    """stage | us per length and mode | share of the total at the longest cached prompt."""
    cols = [(str(n), m) for n in lens for m in ("first", "cached")]
    longest = results[str(max(lens))]["cached"]
    head = "stage".ljust(20) + "".join(f"{n}/{m}".rjust(13) for n, m in cols) + "   share*"
    lines = [head, "-" * len(head)]
    for stage in (*API_IN, *CORE, *API_OUT, "total", *NOT_SUMMED):
        row = stage.ljust(20) + "".join(f"{results[n][m][stage]['us']:13.1f}" for n, m in cols)
        share = longest[stage]["us"] / longest["total"]["us"] if longest["total"]["us"] else 0
        lines.append(row + f"   {share:6.1%}")
    lines.append("steps_to_first_tok  " + "".join(
        f"{results[n][m]['steps_to_first_token']:13.0f}" for n, m in cols))  # fmt: skip
    lines.append(
        f"(us: median wall; * share of the {max(lens)}/cached total; prefix_lookup is "
        "inside schedule, json_body replaces first_sse_chunk when not streamed)"
    )
    return "\n".join(lines)


# ---- end to end ------------------------------------------------------------------------------
def e2e(model_dir: Path, lens: list[int], repeats: int) -> dict[str, Any]:
    """Served TTFT (max_tokens=1, not streamed) minus the engine's steps for the same request."""
    import http.client

    from common import start_server

    server = start_server("--model", str(model_dir), "--load-format", "dummy", "--level", "0",
                          "--dtype", "float32", "--max-model-len", str(MAX_LEN),
                          "--served-model-name", SERVED, "--num-kv-blocks", str(NUM_KV_BLOCKS))  # fmt: skip
    try:
        server.wait_healthy(180)
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        rng = random.Random(1)
        hits: list[int] = []

        def post(text: str) -> float:
            body = json.dumps({"model": SERVED, "prompt": text, "max_tokens": 1,
                               "temperature": 0.0})  # fmt: skip
            t0 = time.perf_counter()
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            dt = time.perf_counter() - t0
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            hits.append(json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"])
            return dt * 1e6

        for _ in range(3):
            post(prompt_text(rng, 64))
        served: dict[str, Any] = {}
        for n in lens:
            same = prompt_text(rng, n)
            post(same)
            first, cached = [], []
            for _ in range(repeats):
                first.append(post(prompt_text(rng, n)))
                cached.append(post(same))
            repeated = hits[-1 : -2 * repeats - 1 : -2]
            if min(repeated) < (n - 1) // 16 * 16:  # every repeated prompt hit in full
                raise RuntimeError(f"a repeated {n}-token prompt missed the cache: {repeated}")
            served[str(n)] = {"first": statistics.median(first),
                              "cached": statistics.median(cached)}  # fmt: skip
    finally:
        server.stop()
    engine = engine_steps(model_dir, lens, repeats)
    out: dict[str, Any] = {}
    for n in map(str, lens):
        out[n] = {
            m: {
                "ttft_us": round(served[n][m], 1),
                "engine_steps_us": round(engine[n][m], 1),
                "remainder_us": round(served[n][m] - engine[n][m], 1),
            }  # fmt: skip
            for m in ("first", "cached")
        }
    return out


def engine_steps(model_dir: Path, lens: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """Median us of LLMEngine.step() calls, real forward, until a max_tokens=1 request's token."""
    from atom.engine import SamplingParams

    engine = RequestPath(model_dir, real_forward=True).engine
    rng = random.Random(1)
    tok_of = lambda text: [1, *text.encode()]  # noqa: E731 - the byte tokenizer, BOS 1

    def once(ids: list[int]) -> float:
        engine.add_request(f"e{rng.random()}", ids, SamplingParams(temperature=0.0, max_tokens=1))
        t0 = time.perf_counter()
        while not any(o.new_token_ids for o in engine.step()):
            pass
        dt = time.perf_counter() - t0
        while engine.has_unfinished_requests():
            engine.step()
        return dt * 1e6

    for _ in range(3):
        once(tok_of(prompt_text(rng, 64)))
    out: dict[str, dict[str, float]] = {}
    for n in lens:
        same = tok_of(prompt_text(rng, n))
        once(same)
        first = [once(tok_of(prompt_text(rng, n))) for _ in range(repeats)]
        cached = [once(same) for _ in range(repeats)]
        out[str(n)] = {"first": statistics.median(first), "cached": statistics.median(cached)}
    return out


# ---- before/after ----------------------------------------------------------------------------
def child(runtime: Path, args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(runtime), str(REPO / "bench")]),
               OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--model-dir",
           str(model_dir), "--repeats", str(args.repeats), "--lens", *map(str, args.lens)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"child run failed ({runtime}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """REV's runtime/ and this tree's in alternating child runs; per stage the median of the
    rounds' medians."""
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": archived_runtime(args.compare, Path(tmp)), "after": REPO / "runtime"}
        runs: dict[str, list[dict[str, Any]]] = {k: [] for k in sides}
        for _ in range(args.rounds):
            for name, path in sides.items():
                runs[name].append(child(path, args, model_dir))
    merged: dict[str, Any] = {}
    for name, side in runs.items():
        merged[name] = {}
        for n in map(str, args.lens):
            merged[name][n] = {}
            for m in ("first", "cached"):
                stages = side[0][n][m]
                merged[name][n][m] = {
                    k: ({u: round(statistics.median(r[n][m][k][u] for r in side), 1)
                         for u in ("us", "cpu_us")} if isinstance(v, dict) else v)
                    for k, v in stages.items()
                }  # fmt: skip
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 1024, 4096])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--e2e", action="store_true", help="also the served TTFT (atom-runtime serve)")
    ap.add_argument("--compare", metavar="REV", help="also time REV's runtime/ (before)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if max(args.lens) >= MAX_LEN:
        ap.error(f"prompts below {MAX_LEN} tokens")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else long_tiny_llama(Path(tmp) / "m")
        if args.child:
            print(json.dumps(measure(model_dir, args.lens, args.repeats)))
            return
        report: dict[str, Any] = {"bench": "request_path", "commit": git_commit(short=True),
                                  "repeats": args.repeats}  # fmt: skip
        if args.compare:
            report["compare"] = compare(args, model_dir)
            for side, res in report["compare"].items():
                print(f"== {side}", file=sys.stderr)
                print(table(res, args.lens), file=sys.stderr)
        else:
            report["results"] = measure(model_dir, args.lens, args.repeats)
            print(table(report["results"], args.lens), file=sys.stderr)
        if args.e2e:
            report["e2e"] = e2e(model_dir, args.lens, max(5, args.repeats // 3))
            print(json.dumps(report["e2e"], indent=1), file=sys.stderr)
    emit_report(report, args.out)


if __name__ == "__main__":
    main()
