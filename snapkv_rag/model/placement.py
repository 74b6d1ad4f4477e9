"""Where a model's layers are: one device, or several under a ``device_map``."""

from __future__ import annotations

import weakref

import torch

# model -> every device it spans, for models loaded over several (a device_map): the engine runs
# them from their first device, and a clock or a peak read there must cover the others too
_SPREAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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


def model_devices(model) -> tuple[torch.device, ...]:
    """Every device the model's weights sit on, the first parameter's first."""
    return tuple(dict.fromkeys(p.device for p in model.parameters()))


def spans_devices(model) -> bool:
    """Whether the model's weights sit on more than one device (a ``device_map`` over GPUs)."""
    return len(model_devices(model)) > 1


def note_placement(model) -> None:
    """Remember the devices ``model`` spans (when several), for :func:`placed_with`."""
    devices = model_devices(model)
    if len(devices) > 1:
        _SPREAD[model] = devices


def placed_with(device: torch.device) -> tuple[torch.device, ...]:
    """``device`` and every other device that a model running on it (:func:`note_placement`) spans:
    what a timing or a memory peak read on ``device`` must cover."""
    found = dict.fromkeys([device])
    for devices in list(_SPREAD.values()):
        if device in devices:
            found.update(dict.fromkeys(devices))
    return tuple(found)
