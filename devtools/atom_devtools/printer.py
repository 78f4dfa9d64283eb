"""The demo's narration: numbered steps with their elapsed time, and indented detail lines."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from atom_devtools.kubectl import ROOT


class Printer:
    """Numbered steps and indented detail lines, flushed at once (the README shows them)."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self.step_no = 0
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        self.step_no += 1
        elapsed = time.monotonic() - self.started
        print(f"\n[{self.step_no}] {text}  (t={elapsed:.0f}s)", file=self.out, flush=True)

    def detail(self, text: str) -> None:
        for line in text.rstrip().splitlines():
            print(f"    {line}", file=self.out, flush=True)


def relative(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
