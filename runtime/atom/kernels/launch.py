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


def zeroed_counters(held: dict[torch.device, list[torch.Tensor]], device: torch.device, n: int,
                    minimum: int) -> torch.Tensor:
    """At least n int32 arrival counters on device, zero between launches (each launch's last
    arriving program re-arms its own). Never freed or replaced while graphs may hold their
    address: a larger need allocates another buffer and keeps the old ones alive in held."""
    buffers = held.setdefault(device, [])
    if not buffers or buffers[-1].numel() < n:
        buffers.append(torch.zeros(max(n, minimum), dtype=torch.int32, device=device))
    return buffers[-1]
