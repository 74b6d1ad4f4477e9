"""Where a model's layers are: one device, or several under a ``device_map``."""

from __future__ import annotations

import torch


def layer_devices(model) -> dict[int, torch.device]:
    """Attention layer index -> the device its weights (and so its K/V) are on."""
    found: dict[int, torch.device] = {}
    for module in model.modules():
        index = getattr(module, "layer_idx", None)
        if isinstance(index, int) and index not in found:
            weight = next(module.parameters(), None)
            if weight is not None:
                found[index] = weight.device
    return found


def spans_devices(model) -> bool:
    """Whether the model's weights sit on more than one device (a ``device_map`` over GPUs)."""
    return len({p.device for p in model.parameters()}) > 1
