"""Tensor parallelism's process side on the CPU (gloo, 2 ranks), through `atom-runtime`.

The model may not shard yet: each rank then computes the full forward, and rank 0's greedy
tokens must still be exactly TP=1's (the step broadcast, the pending-token broadcast and the
lock-step warm-up are what is tested). Killing rank 1 ends the server with an error naming
the rank, and in-flight streams end with an error event, within seconds.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from server_proc import REPO, TINY_SERVER_ARGS, Proc, kill_during_streams, start_server

from atom.config import Config
from atom.entrypoints.server import ServerState, create_app, health
from atom.executor.checks import check_tensor_parallel

MODEL = "tiny-llama"
PROMPTS = ["hello", "the quick brown fox", "tensor parallel ranks in lock-step", "x" * 40]
TP2 = ("--tensor-parallel-size", "2")
ENV = {"OMP_NUM_THREADS": "1"}


def _servers(*extra: str) -> Iterator[tuple[Proc, Proc]]:
    # The TP server compares every step's logits across its ranks (a worker that ran another
    # forward than rank 0's would end it): the unsharded workers' work is checked too.
    one = start_server(*extra, env=ENV)
    two = start_server(*extra, *TP2, env={**ENV, "ATOM_TP_CHECK_STEPS": "1"})
    try:
        one.wait_healthy(180)
        two.wait_healthy(180)
        yield one, two
    finally:
        one.stop()
        two.stop()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Proc, Proc]]:
    yield from _servers()


def _status(url: str) -> dict:
    return httpx.get(url + "/status", timeout=10).json()


def _complete(url: str, prompt: str, max_tokens: int = 12) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 1}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_tp2_greedy_tokens_are_tp1s(servers: tuple[Proc, Proc]) -> None:
    one, two = servers
    for prompt in PROMPTS:
        a, b = _complete(one.url, prompt), _complete(two.url, prompt)
        assert a["text"] == b["text"], prompt
        assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"], prompt


def test_tp2_concurrent_streams_match_tp1(servers: tuple[Proc, Proc]) -> None:
    """Many requests in one batch: decode steps read the previous step's tokens on the device
    (asynchronous scheduling), so the workers get them by broadcast."""
    one, two = servers

    async def texts(url: str) -> list[str]:
        async with httpx.AsyncClient(timeout=120) as c:
            async def one_req(i: int) -> str:
                body = {"model": MODEL, "prompt": f"prompt {i} " * (1 + i % 5), "max_tokens": 16,
                        "temperature": 0.0, "ignore_eos": True}
                r = await c.post(url + "/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one_req(i) for i in range(16)))

    assert asyncio.run(texts(two.url)) == asyncio.run(texts(one.url))


def test_status_lists_every_ranks_pid(servers: tuple[Proc, Proc]) -> None:
    one, two = servers
    s1, s2 = _status(one.url), _status(two.url)
    assert s1["tensor_parallel_size"] == 1 and s1["tp_pids"] == [s1["core_pid"]]
    assert s2["tensor_parallel_size"] == 2 and len(s2["tp_pids"]) == 2
    assert s2["tp_pids"][0] == s2["core_pid"] and s2["tp_pids"][1] not in (s2["pid"], s2["core_pid"])
    assert _pid_alive(s2["tp_pids"][1])


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not reaped) is gone too
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **ENV}
    return subprocess.run([sys.executable, "-m", "atom.cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_warmup_with_two_ranks() -> None:
    r = _cli("warmup", *TINY_SERVER_ARGS, "--num-kv-blocks", "256", *TP2)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["tensor_parallel_size"] == 2 and len(out["tp_pids"]) == 2
    assert out["summary"]["kv_blocks_total"] == 256
    assert "rank 1: shut down after" in r.stderr  # the worker followed rank 0 and stopped


def test_a_role_without_tp_support_is_a_one_line_error() -> None:
    t0 = time.monotonic()
    r = _cli("serve", *TINY_SERVER_ARGS, "--role", "prefill", *TP2, "--port", "0", timeout=60)
    assert r.returncode == 2
    assert "needs --role unified" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30  # refused before any engine process starts


def test_more_ranks_than_gpus_is_refused() -> None:
    config = Config(model=MODEL, load_format="dummy", device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="needs 4 GPUs, 2 visible"):
        check_tensor_parallel(config, "cuda", 2)
    check_tensor_parallel(config, "cpu", None)  # gloo: any number of CPU ranks
    check_tensor_parallel(config, "cuda", 4)


@pytest.mark.gpu
def test_serve_with_more_ranks_than_gpus_exits_with_the_reason() -> None:
    import torch

    n = torch.cuda.device_count() + 1
    proc = start_server("--tensor-parallel-size", str(n), "--device", "cuda", env=ENV)
    try:
        code = proc.proc.wait(180)
        assert code != 0 and f"needs {n} GPUs" in proc.log()
    finally:
        proc.stop()


@pytest.mark.skipif(importlib.util.find_spec("atom.distributed.communication") is None,
                    reason="the model does not shard yet (atom.distributed.communication): "
                           "any size runs, unsharded")
def test_a_size_that_does_not_divide_the_heads_is_a_clean_start_up_error() -> None:
    """tiny-llama has 4 heads and 2 KV heads: 3 ranks cannot split them (the model's error,
    raised on every rank; it must reach the log as one line and end the server)."""
    proc = start_server("--tensor-parallel-size", "3", env=ENV)
    try:
        code = proc.proc.wait(180)
        log = proc.log()
        assert code != 0 and "Traceback" not in log, log
        assert "start-up failed" in log or "tensor-parallel rank" in log, log
    finally:
        proc.stop()


def test_killing_rank1_ends_the_server_and_every_stream() -> None:
    proc = start_server(*TP2, env=ENV)
    try:
        proc.wait_healthy(180)
        rank1 = _status(proc.url)["tp_pids"][1]
        bodies = [{"model": MODEL, "prompt": f"long {i}", "max_tokens": 1900, "ignore_eos": True,
                   "stream": True} for i in range(4)]
        streams, took = kill_during_streams(proc.url, rank1, bodies)
        assert took < 10, took
        for lines in streams:
            errors = [json.loads(x[6:])["error"] for x in lines
                      if x.startswith("data: {") and '"error"' in x]
            assert lines[-1].startswith("cut") or errors, lines[-3:]
            for err in errors:
                assert err["code"] == "engine_unavailable" and "rank 1" in err["message"], err
        assert proc.proc.wait(30) != 0
        log = proc.log()
        assert f"tensor-parallel rank 1 (pid {rank1}) was killed by SIGKILL" in log, log
        assert not _pid_alive(rank1)
    finally:
        proc.stop()


def test_health_names_the_dead_rank_while_the_server_exits() -> None:
    from aiohttp.test_utils import make_mocked_request

    reason = "tensor-parallel rank 1 (pid 42) was killed by SIGKILL"
    engine = SimpleNamespace(state="failed", reason=reason, is_ready=False, on_ready=[],
                             last_stats={}, warmup_summary={})
    state = ServerState(engine=engine, served_model_name=MODEL, model=MODEL, draining=True)
    request = make_mocked_request("GET", "/health", app=create_app(state))
    response = asyncio.run(health(request))
    assert response.status == 503
    assert json.loads(response.body) == {"status": "failed", "reason": reason}


def test_one_rank_is_the_plain_model_runner() -> None:
    """N = 1 keeps today's path: the engine drives a ModelRunner itself, no worker, no group."""
    import multiprocessing

    from atom.engine import LLMEngine
    from atom.engine.model_runner import ModelRunner
    from atom.executor.executor import ModelExecutor

    engine = LLMEngine(Config(model=MODEL, load_format="dummy", dtype="float32", device="cpu",
                              max_model_len=64, num_kv_blocks=16, max_num_seqs=2))
    assert type(engine.runner) is ModelRunner
    assert isinstance(engine.runner, ModelExecutor)  # the one-rank executor is the runner
    assert multiprocessing.active_children() == []
    engine.shutdown()  # nothing to stop


def test_a_step_message_carries_the_batch_exactly() -> None:
    """Unchanged block tables travel as None and are restored on the worker's side."""
    import msgspec

    from atom.engine.batch import PENDING_TOKEN, SeqRows, StepBatch
    from atom.executor import messages as m

    def step(tables: list[list[int]]) -> StepBatch:
        return StepBatch([SeqRows("a", [5, 6, 7], 0, tables[0], None, True),
                          SeqRows("b", [PENDING_TOKEN], 9, tables[1], 1, True),
                          SeqRows("c", [8, 9], 16, tables[2], None, False)], is_prefill=True)

    send, receive, dec = m.TableDelta(), m.TableDelta(), m.command_decoder()
    grown = [3]  # the engine appends to a sequence's table in place
    for tables, sent in (([grown, [1, 4], [2, 0]], [[3], [1, 4], [2, 0]]),
                         ([grown, [1, 4], [2, 7]], [None, None, [2, 7]]),
                         ([grown, [1, 4], [2, 7]], [[3, 9], None, None])):
        if sent[0] == [3, 9]:
            grown.append(9)
        batch = step(tables)
        msg = dec.decode(msgspec.msgpack.encode(m.ExecuteStep.of(batch, 2, send)))
        assert isinstance(msg, m.ExecuteStep) and msg.pending == 2
        assert msg.block_tables == sent
        back = msg.batch(receive)
        assert back.rows == batch.rows and back.is_prefill and not back.logits_all


def test_sigterm_drains_and_stops_the_workers_cleanly() -> None:
    proc = start_server(*TP2, env=ENV)
    try:
        proc.wait_healthy(180)
        rank1 = _status(proc.url)["tp_pids"][1]
        assert _complete(proc.url, "before the drain")["text"]
        assert proc.terminate(60) == 0
        assert "rank 1: shut down after" in proc.log()  # Shutdown reached it (not a kill)
        assert not _pid_alive(rank1)
    finally:
        proc.stop()


def test_a_stuck_rank_times_out_its_collective_and_ends_the_server() -> None:
    """A rank alive but stopped (SIGSTOP) is no death its watcher sees: rank 0's next
    collective times out (ATOM_TP_COLLECTIVE_TIMEOUT_S after warm-up) and ends the server."""
    proc = start_server(*TP2, env={**ENV, "ATOM_TP_COLLECTIVE_TIMEOUT_S": "3"})
    rank1 = None
    try:
        proc.wait_healthy(180)
        rank1 = _status(proc.url)["tp_pids"][1]
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        r = httpx.post(proc.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hi", "max_tokens": 5})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "engine_unavailable" and "Timed out" in err["message"], err
        assert proc.proc.wait(30) != 0
        assert time.monotonic() - t0 < 30
    finally:
        if rank1 is not None and _pid_alive(rank1):
            os.kill(rank1, signal.SIGCONT)
        proc.stop()
