"""bench/step_timeline.py: charging a step's wall time to overlapping kernels."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from step_timeline import Kernel, charged_by_label, charges, labels, steps  # noqa: E402


def test_overlapping_kernels_are_charged_what_they_add_to_the_end() -> None:
    # b starts early and ends 3 after a; c ends inside b (charged nothing); d after a gap.
    step = [Kernel("a", 0, 10), Kernel("b", 2, 13), Kernel("c", 5, 12), Kernel("d", 15, 16)]
    assert charges(step) == [10, 3, 0, 3]
    assert sum(charges(step)) == 16  # the span: first start to last end


def test_labels_tell_apart_a_kernel_used_several_times_a_layer() -> None:
    two_layers = ["g", "attn", "g", "g", "attn", "g", "head"]
    step = [Kernel(n, i, i + 1) for i, n in enumerate(two_layers)]
    assert labels(step, layers=2) == ["g#0", "attn", "g#1", "g#0", "attn", "g#1", "head"]


def test_steps_split_in_start_order_and_medians_per_label() -> None:
    one = [Kernel("x", 0, 4), Kernel("y", 1, 6)]
    two = [Kernel("x", 10, 12), Kernel("y", 11, 15)]
    three = [Kernel("x", 20, 23), Kernel("y", 24, 25)]
    kernels = three + one + two  # any order in
    assert [s[0].start_us for s in steps(kernels, 2)] == [0, 10, 20]
    span, charged = charged_by_label(kernels, per_step=2, layers=1)
    assert span == 5  # spans 6, 5, 5
    assert charged == [("x", 3), ("y", 2)]  # x: 4, 2, 3; y: 2, 3, 2
    with pytest.raises(ValueError, match="do not split"):
        steps(kernels, 4)


def test_gpu_activities_count_cuda_events_by_name() -> None:
    import torch

    from step_timeline import gpu_activities

    class Event:
        def __init__(self, name: str, cuda: bool, start: float, end: float) -> None:
            self.name, self.device_time_total = name, end - start
            self.device_type = (torch.autograd.DeviceType.CUDA if cuda
                                else torch.autograd.DeviceType.CPU)
            self.time_range = type("Range", (), {"start": start, "end": end})()

    events = [Event("gemv", True, 0, 4), Event("host op", False, 0, 9), Event("gemv", True, 5, 7),
              Event("x" * 100, True, 8, 9)]
    per, timeline = gpu_activities(events, name_chars=10)
    assert per == {"gemv": [2, 6], "x" * 10: [1, 1]}
    assert timeline == [Kernel("gemv", 0, 4), Kernel("gemv", 5, 7), Kernel("x" * 10, 8, 9)]
