"""Where a step's wall time goes when its kernels overlap (issue 5).

With early launches a kernel's own duration includes its wait for the kernel before it, so
per-kernel durations no longer add up to the step. Instead each kernel is charged the time by
which it pushes the end of the step further: its end minus the latest end of the kernels that
started before it (the first kernel of a step: its whole duration). The charges of a step add
up to its span on the GPU, first start to last end; idle time before a kernel is charged to it.

Kernels of one name that run several times per layer (the projections share one kernel) are
told apart by their order within the layer: `name#i`, i counting that name's launches in the
layer, when a step's launches of the name are a multiple of the layer count.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from statistics import median
from typing import Any, NamedTuple


class Kernel(NamedTuple):
    name: str
    start_us: float
    end_us: float


def gpu_activities(events: Iterable[Any], name_chars: int = 90
                   ) -> tuple[dict[str, list[float]], list[Kernel]]:
    """A torch.profiler run's CUDA activities: per name [calls, total us], and each one as a
    Kernel (name cut to name_chars), in the profiler's order."""
    import torch

    per: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    timeline = []
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:name_chars]
            per[name][0] += 1
            per[name][1] += (ev.device_time_total if hasattr(ev, "device_time_total")
                             else ev.cuda_time)
            timeline.append(Kernel(name, ev.time_range.start, ev.time_range.end))
    return per, timeline


def steps(kernels: Sequence[Kernel], per_step: int) -> list[list[Kernel]]:
    """The kernels of consecutive steps, in start order, per_step each."""
    ordered = sorted(kernels, key=lambda k: k.start_us)
    if not per_step or len(ordered) % per_step:
        raise ValueError(f"{len(ordered)} kernels do not split into steps of {per_step}")
    return [ordered[i:i + per_step] for i in range(0, len(ordered), per_step)]


def charges(step: Sequence[Kernel]) -> list[float]:
    """Each kernel's push of the step's end (microseconds), in the step's order."""
    out, latest = [], step[0].start_us if step else 0.0
    for k in step:
        out.append(max(0.0, k.end_us - latest))
        latest = max(latest, k.end_us)
    return out


def labels(step: Sequence[Kernel], layers: int) -> list[str]:
    """name#i for a name launched a multiple of `layers` times in the step (i: its order within
    a layer), else the name."""
    counts = Counter(k.name for k in step)
    seen: Counter[str] = Counter()
    out = []
    for k in step:
        per_layer, rest = divmod(counts[k.name], layers)
        if per_layer > 1 and not rest:
            out.append(f"{k.name}#{seen[k.name] % per_layer}")
        else:
            out.append(k.name)
        seen[k.name] += 1
    return out


def charged_by_label(kernels: Sequence[Kernel], per_step: int, layers: int
                     ) -> tuple[float, list[tuple[str, float]]]:
    """(median GPU span of a step, [(label, median us charged per step)]), in the order the
    labels first appear in a step."""
    per_label: dict[str, list[float]] = defaultdict(list)
    spans = []
    for step in steps(kernels, per_step):
        in_step: dict[str, float] = defaultdict(float)
        for label, charge in zip(labels(step, layers), charges(step), strict=True):
            in_step[label] += charge
        for label, total in in_step.items():
            per_label[label].append(total)
        spans.append(max(k.end_us for k in step) - step[0].start_us)
    return median(spans), [(label, median(v)) for label, v in per_label.items()]
