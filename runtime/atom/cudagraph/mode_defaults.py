"""The level-3 graph mode by model size (issue 47: FULL against TR_HYBRID, measured at 1B and
8B): the table the default comes from when the configuration sets no mode.

Empty until the GPU measurement fills it: every size keeps TR_HYBRID, the level-3 default.
A row names where its numbers are, so the table cannot drift from the measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

from atom.config import CUDAGraphMode


@dataclass(frozen=True)
class SizeDefault:
    """Models of up to max_params parameters run `mode` unless configured otherwise."""

    max_params: int
    mode: CUDAGraphMode
    measured: str  # the bench/RESULTS.md row (card, command) the choice comes from


MODE_BY_SIZE: tuple[SizeDefault, ...] = ()


def default_mode(num_params: int, table: tuple[SizeDefault, ...] | None = None,
                 fallback: CUDAGraphMode = CUDAGraphMode.TR_HYBRID) -> CUDAGraphMode:
    """The mode of the smallest row (of table, default MODE_BY_SIZE) holding num_params,
    else fallback."""
    for row in sorted(MODE_BY_SIZE if table is None else table, key=lambda r: r.max_params):
        if num_params <= row.max_params:
            return row.mode
    return fallback
