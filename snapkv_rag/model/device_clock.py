"""Wall-clock readings that count the device's work: CUDA runs kernels asynchronously, so a clock
read right after a launch measures the launch, not the work; the device is synchronised first."""

from __future__ import annotations

import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished what was queued on it."""
    synchronize(device)
    return time.perf_counter()
