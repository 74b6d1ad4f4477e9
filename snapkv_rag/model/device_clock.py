"""Wall-clock readings that count the device's work: CUDA runs kernels asynchronously, so a clock
read right after a launch measures the launch, not the work; the device is synchronised first, and
under a ``device_map`` every device the model spans (its last layers' work queues on the last GPU)."""

from __future__ import annotations

import time

import torch

from .placement import placed_with


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` and the other devices its model spans (nothing to wait for on a CPU)."""
    for placed in placed_with(device):
        if placed.type == "cuda":
            torch.cuda.synchronize(placed)


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished what was queued on it."""
    synchronize(device)
    return time.perf_counter()
