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
