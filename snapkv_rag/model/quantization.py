"""Weight-only int8 quantization of a model's linear layers, for decode on the CPU.

A decode step multiplies one row per sequence by every weight matrix, so on a CPU it is bound by
reading the weights: int8 halves the bytes of bf16. The matrix products run in PyTorch's own
``aten._weight_int8pack_mm`` kernel (per-output-channel scales, activations in the model's dtype;
the output head stays in the model's dtype, see :func:`quantize_linear_weights`); with few rows
it is 2-4x faster than a bf16 ``linear`` here, though the whole decode step was not faster
(eval/decoding/RESULTS.md, "Weight-only int8"). With many rows (a prefill chunk) that kernel is slower than a dequantized ``linear``, so
those take the dequantized path. torchao's int8 weight-only tensors reach a kernel like this one
through tensor-subclass dispatch, which in eager mode made decode slower, not faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidDeviceError
from .packed_linear import FusedLinears, FusedMember, packed_parameter_count, replace_module, sibling_groups

WEIGHT_FORMATS = ("native", "int8")
# The kernel reads the reduction dimension in blocks of 16: other widths crash it or (8) give wrong
# results, so such layers keep their native weights.
KERNEL_IN_FEATURES_MULTIPLE = 16
# Up to this many rows the int8 kernel wins; a prefill chunk of hundreds of rows is faster as a
# dequantized bf16 product (measured at 1, 4, 16 and 512 rows on 576x576 to 49152x576 weights).
INT8_KERNEL_MAX_ROWS = 32


def int8_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear(nn.Module):
    """A ``nn.Linear`` with symmetric per-output-channel int8 weights and scales in the compute dtype."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear | None, *, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None):
        """From ``linear``'s weight, or from ``parts`` (int8 weight, scales, bias) already made."""
        super().__init__()
        if linear is not None:
            weight = linear.weight.detach()
            scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
            quantized = torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
            parts = (quantized, scale.to(weight.dtype), None if linear.bias is None else linear.bias.detach())
        assert parts is not None
        quantized, scale, bias = parts
        self.out_features, self.in_features = quantized.shape
        self.register_buffer("qweight", quantized.contiguous())
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    @classmethod
    def stacked(cls, layers: list[Int8Linear]) -> Int8Linear:
        """One layer with the rows of ``layers`` (their int8 weights and scales as they are)."""
        biases = [m.bias for m in layers]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases if b is not None])
        return cls(None, parts=(torch.cat([m.qweight for m in layers]), torch.cat([m.scale for m in layers]), bias))

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (what the int8 kernel multiplies by), for code that reads it."""
        return self.qweight.to(self.scale.dtype) * self.scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= INT8_KERNEL_MAX_ROWS and x.dtype == self.scale.dtype:
            flat = x.reshape(rows, x.shape[-1]).contiguous()
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scale).reshape(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, weights=int8"


def weight_format(model: nn.Module) -> str:
    int8 = any(isinstance(m, Int8Linear) or (isinstance(m, FusedMember) and isinstance(m.group.packed, Int8Linear)) for m in model.modules())
    return "int8" if int8 else "native"


def fuse_int8_siblings(model: nn.Module) -> int:
    """Give int8 sibling layers that read the same input (a layer's q/k/v, the MLP's gate/up) one
    stacked int8 weight (:class:`~snapkv_rag.model.packed_linear.FusedLinears`): one kernel call
    instead of three or two, the same int8 values and scales. Returns how many groups were made."""
    layers = [(name, m) for name, m in model.named_modules() if type(m) is Int8Linear]
    by_name = dict(layers)
    fused = 0
    for names in sibling_groups(model, layers):
        members = [by_name[n] for n in names]
        if len({(m.in_features, m.dtype, m.bias is None) for m in members}) != 1:
            continue
        group = FusedLinears(members, product=Int8Linear.stacked(members))
        for index, (name, linear) in enumerate(zip(names, members)):
            replace_module(model, name, FusedMember(group, index, linear))
        fused += 1
    return fused


def parameter_count(model: nn.Module) -> int:
    """Parameters, int8 and packed weights included (they are not ``nn.Parameter``)."""
    quantized = sum(m.qweight.numel() for m in model.modules() if isinstance(m, Int8Linear))
    return sum(p.numel() for p in model.parameters()) + quantized + packed_parameter_count(model)


def quantizable(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.in_features % KERNEL_IN_FEATURES_MULTIPLE == 0


def quantize_linear_weights(model: nn.Module, *, output_head: bool = False) -> int:
    """Replace every ``nn.Linear`` of ``model`` whose input width the kernel takes by an
    :class:`Int8Linear`; returns how many were replaced.

    The output head stays in the model's dtype unless ``output_head``: on the embedded model an
    int8 head doubled the next-token KL that int8 adds (0.0043 against 0.0023 over fp32, bf16
    itself 0.0009) for about 2 ms of a decode step (eval/decoding/RESULTS.md, "Weight-only int8")."""
    if not int8_kernel_available():
        raise InvalidDeviceError(f"weights='int8' needs torch.ops.aten._weight_int8pack_mm, which torch {torch.__version__} lacks")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    targets = [(name, module) for name, module in model.named_modules() if quantizable(module) and (output_head or module is not head)]
    for name, module in targets:
        replace_module(model, name, Int8Linear(module))
    config = getattr(model, "config", None)
    if config is not None and head is not None and any(module is head for _, module in targets) and hasattr(config, "tie_word_embeddings"):
        config.tie_word_embeddings = False  # so a later tie_weights() does not put a float head back
    return len(targets)


def choose_weights(weights: str | None, device: torch.device) -> str:
    """The weight format to load: ``"native"`` (also for None) or ``"int8"``.

    int8 is an option, not the default: on the embedded model it decodes faster but answered 2-3
    fewer of the 40 sample questions than bf16, which lost none (eval/decoding/RESULTS.md, "Weight-only int8")."""
    fmt = "native" if weights is None else str(weights).lower()
    if fmt not in WEIGHT_FORMATS:
        raise InvalidDeviceError(f"unknown weights format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    if fmt == "int8" and device.type != "cpu":
        raise InvalidDeviceError(f"weights='int8' is for decode on the CPU; on {device.type} load the native weights")
    return fmt
