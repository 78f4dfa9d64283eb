"""ATOM_STEP_TRACE: the engine core's per-step records (atom.entrypoints.core.step_trace) from
a real `atom-runtime serve`, and bench/step_trace_report.py's summary of them."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import httpx
from server_proc import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from step_trace_report import load, summarise  # noqa: E402

MODEL = "tiny-llama"


def test_served_steps_are_traced_and_summarised(tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    proc = start_server(env={"ATOM_STEP_TRACE": str(trace)})
    try:
        proc.wait_healthy()
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 12, "ignore_eos": True}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(30) == 0, proc.log()
    finally:
        proc.stop()
    rows = load(str(trace))  # flushed at exit
    # The warm-up does not run through the loop: the request's prefill is the first record.
    first = rows[0]
    assert first["prefill"] is True and first["seqs"] == 1 and first["tokens"] == prompt_tokens
    decodes = [r for r in rows if not r["prefill"] and r["seqs"]]
    assert decodes and all(r["tokens"] == r["seqs"] == 1 for r in decodes)
    assert all(r["step_us"] > 0 for r in rows)
    assert all(r["route_us"] > 0 for r in rows if r["outs"])  # sending outputs takes time
    # each step and the routing after it end before the next step starts (t is rounded to 1 us)
    for row, after in zip(rows, rows[1:], strict=False):
        assert after["t"] - row["t"] >= (row["step_us"] + row["route_us"]) * 1e-6 - 2e-6, row
    # the launch is part of the step: scheduling and launching, before reading the one before
    assert all(0 < r["launch_us"] <= r["step_us"] for r in rows if r["seqs"])
    assert sum(r["outs"] for r in rows) >= 12  # each of the 12 tokens left in some step's outputs
    report = summarise(rows, gap_ms=1e6, min_seqs=1)
    assert report["decode"]["steps"] + report.get("prefill_or_mixed", {}).get("steps", 0) == len(
        [r for r in rows[:-1] if r["seqs"]]
    )
    assert report["after_mixed"]["steps"] >= 1  # the decode step that read the prefill
