"""Summarise an engine core's step trace (ATOM_STEP_TRACE, atom.entrypoints.core.step_trace).

Where a served load's wall time went, turn by turn: decode steps and prefill/mixed steps
(their share, median step and routing times, median sequences and tokens), and the loop's
own time between steps (draining input, stats). Only the busy stretch is read: records
closer than --gap-ms to the one before (longer pauses are idle time between phases).

    python bench/step_trace_report.py /tmp/steps.jsonl [--min-seqs 48] [--out report.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def load(path: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def summarise(rows: list[dict[str, Any]], gap_ms: float, min_seqs: int) -> dict[str, Any]:
    busy: list[tuple[dict[str, Any], float]] = []  # (record, loop time after it, us)
    for a, b in itertools.pairwise(rows):
        end = a["t"] + (a["step_us"] + a["route_us"]) / 1e6
        gap = (b["t"] - end) * 1e6
        if gap <= gap_ms * 1e3 and a["seqs"] >= min_seqs:
            busy.append((a, gap))
    if not busy:
        return {"steps": 0}
    wall = sum(r["step_us"] + r["route_us"] + g for r, g in busy)
    out: dict[str, Any] = {"steps": len(busy), "wall_ms": round(wall / 1e3, 1)}
    # A step() launches one step and then reads the one before it: the step after a mixed one
    # is where the host waits for the mixed step's GPU work.
    after_mixed = {id(b) for a, b in itertools.pairwise(rows) if a["prefill"]}
    groups = (
        ("decode", lambda r: not r["prefill"]),
        ("prefill_or_mixed", lambda r: r["prefill"]),
        ("after_mixed", lambda r: id(r) in after_mixed),
    )
    for kind, pick in groups:
        sel = [(r, g) for r, g in busy if pick(r)]
        if not sel:
            continue
        step = [r["step_us"] for r, _ in sel]
        route = [r["route_us"] for r, _ in sel]
        loop = [g for _, g in sel]
        out[kind] = {
            "steps": len(sel),
            "share_of_steps": round(len(sel) / len(busy), 3),
            "share_of_wall": round((sum(step) + sum(route) + sum(loop)) / wall, 3),
            "step_us_p50": round(statistics.median(step), 1),
            "step_us_p90": round(statistics.quantiles(step, n=10)[-1], 1) if len(step) > 1 else step[0],
            # scheduling + launch of the step (the rest of step_us: reading the one before)
            "launch_us_p50": round(statistics.median(r.get("launch_us", 0.0) for r, _ in sel), 1),
            "route_us_p50": round(statistics.median(route), 1),
            "loop_us_p50": round(statistics.median(loop), 1),
            "seqs_p50": statistics.median(r["seqs"] for r, _ in sel),
            "tokens_p50": statistics.median(r["tokens"] for r, _ in sel),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--gap-ms", type=float, default=50.0, help="longer pauses count as idle")
    ap.add_argument("--min-seqs", type=int, default=1, help="only steps of at least this many")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    report = summarise(load(args.trace), args.gap_ms, args.min_seqs)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
