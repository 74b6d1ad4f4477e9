"""Linear layers whose weights are packed once for oneDNN, for inference on the CPU.

A bf16 or fp32 ``nn.Linear`` on the CPU multiplies through oneDNN, which first reorders the
weight into its blocked layout, on every call. A decode step is bound by reading the weights, so
that reorder (one more pass over every weight per token) cost about a third of the embedded
model's step here. :class:`PackedLinear` keeps the weight in the blocked layout from load time
on: the decoder's linear layers took 1.4-1.6x less time for 1 to 16 rows and 1.05-1.2x less for
prefill chunks of 512-2048 rows in bf16 with bitwise identical results; 1.5-2.2x less in fp32,
within 1e-4 (another kernel: a different summation order). eval/RESULTS.md, "Packed weights".

The packed tensor is opaque and has no gradient, so a forward that needs one (LESS distillation
trains through the model) goes through :func:`unpacked_linears`, which puts plain layers back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch packs ``dtype`` weights for oneDNN on this CPU (bf16: natively only)."""
    ops = torch.ops.mkldnn
    if dtype not in PACKABLE_DTYPES or not (
        torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")
    ):
        return False
    return dtype != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """``nn.Linear`` (CPU, fp32 or bf16) with its weight in oneDNN's blocked layout."""

    def __init__(self, linear: nn.Linear, *, copy_of_tied_weight: bool = False):
        super().__init__()
        weight = linear.weight.detach()
        # an output head that shared the input embeddings' weight: its packed copy is memory, not parameters
        self.copy_of_tied_weight = copy_of_tied_weight
        if weight.device.type != "cpu" or not packing_available(weight.dtype):
            raise ValueError(f"cannot pack a {weight.dtype} weight on {weight.device}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = weight.dtype
        # an opaque mkldnn tensor: kept as a plain attribute, since Module.to()/state_dict() cannot handle it
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        """The plain ``[out, in]`` weight, rebuilt exactly (a product with the identity), for code that reads it."""
        identity = torch.eye(self.in_features, dtype=self.dtype)
        return torch.ops.mkldnn._linear_pointwise(identity, self.packed, None, "none", [], "").t().contiguous()

    @property
    def packed_bytes(self) -> int:
        return self.in_features * self.out_features * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def to_linear(self) -> nn.Linear:
        """A plain layer with the same weight (a copy: a head that was tied to the embeddings stays untied)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=self.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        linear.weight.requires_grad_(False)
        if linear.bias is not None:
            linear.bias.requires_grad_(False)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=onednn"


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model.get_submodule(name)`` is."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def pack_linear_weights(model: nn.Module) -> int:
    """Replace every plain CPU ``nn.Linear`` of ``model`` in a packable dtype by a
    :class:`PackedLinear`; returns how many were replaced (0 where oneDNN cannot pack them)."""
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and module.weight.device.type == "cpu" and packing_available(module.weight.dtype)
    ]
    get_input = getattr(model, "get_input_embeddings", None)
    embeddings = get_input() if callable(get_input) else None
    tied = getattr(embeddings, "weight", None)
    for name, module in targets:
        replace_module(model, name, PackedLinear(module, copy_of_tied_weight=module.weight is tied))
    config = getattr(model, "config", None)
    if targets and config is not None and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False  # the head holds its own packed copy; a tie_weights() must not undo it
    return len(targets)


def packed_layers(model: nn.Module) -> list[tuple[str, PackedLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear)]


def packed_weight_bytes(model: nn.Module) -> int:
    return sum(m.packed_bytes for _, m in packed_layers(model))


def packed_parameter_count(model: nn.Module) -> int:
    """The model's parameters that packed layers hold (a tied head's copy is not counted again)."""
    return sum(m.in_features * m.out_features for _, m in packed_layers(model) if not m.copy_of_tied_weight)


def weight_layout(model: nn.Module) -> str:
    """``"onednn-packed"`` where linear weights were packed (:func:`pack_linear_weights`), else ``"plain"``."""
    return "onednn-packed" if packed_layers(model) else "plain"


@contextmanager
def unpacked_linears(model: nn.Module) -> Iterator[None]:
    """Plain ``nn.Linear`` layers for the duration (for a forward that needs gradients), packed again after."""
    packed = packed_layers(model)
    for name, module in packed:
        replace_module(model, name, module.to_linear())
    try:
        yield
    finally:
        for name, module in packed:
            replace_module(model, name, module)
