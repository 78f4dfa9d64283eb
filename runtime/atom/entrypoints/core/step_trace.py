"""Per-step records of the engine core's loop, for diagnosing served throughput (issue 26).

Off unless ATOM_STEP_TRACE names a file. Then each turn that ran a step appends one record:
when it started, how long `LLMEngine.step()` took and how much of that was scheduling and
launching the new step (the rest is reading the step before: waiting for the GPU), how long
routing its outputs took, and what the step was (sequences, scheduled tokens, whether it held
prefill rows). The gaps between records are the loop's own time (input draining, stats).
Records are buffered and written as JSON lines every FLUSH_EVERY steps and at exit, so the
loop pays a few perf_counter reads and one list append a step.

    ATOM_STEP_TRACE=/tmp/steps.jsonl atom-runtime serve ...
    python bench/step_trace_report.py /tmp/steps.jsonl
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

ENV = "ATOM_STEP_TRACE"
FLUSH_EVERY = 4096


@dataclass
class StepTrace:
    path: str
    _rows: list[tuple[float, float, float, float, int, int, bool, int]] = field(
        default_factory=list
    )

    @classmethod
    def from_env(cls) -> StepTrace | None:
        path = os.environ.get(ENV, "").strip()
        return cls(path) if path else None

    def record(self, start: float, stepped: float, routed: float, engine: Any, outs: int) -> None:
        batch = getattr(engine, "last_batch", None)  # the StepBatch step() launched, if any
        seqs = tokens = 0
        prefill = False
        if batch is not None:
            rows = batch.rows
            seqs, tokens, prefill = len(rows.num_tokens), len(rows.token_ids), batch.is_prefill
        launch = float(getattr(engine, "last_launch_s", 0.0))
        self._rows.append(
            (start, stepped - start, launch, routed - stepped, seqs, tokens, prefill, outs)
        )
        if len(self._rows) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._rows:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            for t, step, launch, route, seqs, tokens, prefill, outs in self._rows:
                f.write(
                    json.dumps(
                        {
                            "t": round(t, 6),
                            "step_us": round(step * 1e6, 1),
                            "launch_us": round(launch * 1e6, 1),
                            "route_us": round(route * 1e6, 1),
                            "seqs": seqs,
                            "tokens": tokens,
                            "prefill": prefill,
                            "outs": outs,
                        }
                    )
                    + "\n"
                )
        self._rows.clear()
