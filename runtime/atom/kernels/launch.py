"""What the device can do for a launch."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def programmatic_launch(device: torch.device) -> bool:
    """Programmatic dependent launch (griddepcontrol): CUDA devices of sm_90 and later."""
    return device.type == "cuda" and _capability(device) >= (9, 0)


@functools.cache
def sm_resources(device: torch.device) -> tuple[int, int]:
    """(SMs, shared-memory bytes per SM) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.shared_memory_per_multiprocessor


class ArrivalCounters:
    """int32 arrival counters per device, zero between launches (each launch's last arriving
    program re-arms its own). Never freed or replaced while graphs may hold their address: a
    larger need allocates another buffer and keeps the old ones alive."""

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum  # the first buffer's size: allocated once, before any capture
        self._held: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        """At least n counters on device."""
        buffers = self._held.setdefault(device, [])
        if not buffers or buffers[-1].numel() < n:
            buffers.append(torch.zeros(max(n, self.minimum), dtype=torch.int32, device=device))
        return buffers[-1]

    def held(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Every buffer allocated on device (none before the first launch that needs one)."""
        return tuple(self._held.get(device, ()))

    def armed(self, device: torch.device) -> bool:
        """Whether a counter on device was left non-zero (a launch that did not re-arm it)."""
        return any(bool(c.any()) for c in self.held(device))
