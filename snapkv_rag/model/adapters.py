"""LoRA adapters: the peft model for training, and a merge at load that needs no peft.

An adapter directory holds peft's files (``adapter_config.json``, ``adapter_model.safetensors``)
and the run's ``manifest.json``. :func:`merge_adapter` adds ``scale * B @ A`` to each adapted
linear weight in place, so a tuned model decodes exactly as fast as its base.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..errors import SnapKVRagError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MANIFEST_FILE = "manifest.json"
_PEFT_PREFIX = "base_model.model."


class AdapterError(SnapKVRagError, ValueError):
    """An adapter directory that is missing, damaged, or does not fit the model."""


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct leaf names of the decoder's linear layers (q_proj, ..., down_proj): LoRA's targets."""
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear) and ".layers." in f".{name}"}
    return sorted(names)


def read_adapter(directory: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{path} is not a LoRA adapter: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
        weights = load_file(str(weights_path))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise AdapterError(f"could not read the adapter in {path}: {exc}") from exc
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise AdapterError(f"{config_path} has no valid {key!r}")
    if config.get("use_dora") or config.get("use_rslora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{config_path}: DoRA, rsLoRA and per-layer rank or alpha patterns are not supported (one r and lora_alpha for every layer)")
    return config, weights


@torch.no_grad()
def merge_adapter(model: nn.Module, directory: str | Path) -> int:
    """Fold the adapter in ``directory`` into ``model``'s linear weights; returns how many layers changed."""
    config, weights = read_adapter(directory)
    scale = float(config["lora_alpha"]) / float(config["r"])
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        stem = key.removeprefix(_PEFT_PREFIX)
        if not stem.endswith(".weight"):
            raise AdapterError(f"unexpected tensor {key!r} in the adapter (only LoRA A/B weights are merged)")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in stem:
                pairs.setdefault(stem.split(marker)[0], {})[part] = tensor
                break
        else:
            raise AdapterError(f"unexpected tensor {key!r} in the adapter (only LoRA A/B weights are merged)")
    modules = dict(model.named_modules())
    for name, pair in pairs.items():
        module = modules.get(name)
        if not isinstance(module, nn.Linear) or set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"adapter layer {name!r} does not match a linear layer of this model")
        delta = pair["lora_B"].float() @ pair["lora_A"].float()
        if delta.shape != module.weight.shape:
            raise AdapterError(f"adapter layer {name!r} has shape {tuple(delta.shape)}, the model's is {tuple(module.weight.shape)}")
        module.weight.copy_((module.weight.float() + scale * delta.to(module.weight.device)).to(module.weight.dtype))
    return len(pairs)


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
