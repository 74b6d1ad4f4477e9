"""Linear layers whose weights are packed once for oneDNN, for inference on the CPU.

A bf16 or fp32 ``nn.Linear`` on the CPU multiplies through oneDNN, which first reorders the
weight into its blocked layout, on every call. A decode step is bound by reading the weights, so
that reorder (one more pass over every weight per token) cost about a third of the embedded
model's step here. :class:`PackedLinear` keeps the weight in the blocked layout from load time
on: the decoder's linear layers took 1.4-1.6x less time for 1 to 16 rows and 1.05-1.2x less for
prefill chunks of 512-2048 rows in bf16 with bitwise identical results; 1.5-2.2x less in fp32,
within 1e-4 (another kernel: a different summation order). eval/decoding/RESULTS.md, "Packed weights".

Sibling layers that read the same input (a layer's query, key and value projections; the MLP's
gate and up projections) are packed as one weight (:class:`FusedLinears`): one oneDNN call instead
of three or two, 5-7% off a decode step here (eval/decoding/RESULTS.md, "Fused projections"). Which layers
share an input is found by running the model once on two tokens, so no model family is named.

The packed tensor is opaque and has no gradient, so a forward that needs one (LESS distillation
trains through the model) goes through :func:`unpacked_linears`, which puts plain layers back.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

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


# A compiled graph cannot take an opaque mkldnn tensor as an input, and Inductor's own lowering of
# oneDNN's linear expects a weight it froze itself. So a compiled forward multiplies through this
# op, which names the packed weight by a handle: the graph holds an int, the kernel is oneDNN's.
_PACKED_WEIGHTS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
_HANDLES = itertools.count()


# Defined on a plain Library, not with torch.library.custom_op: its Python wrapper cost 17 us a
# call against 9 here, and a decode step makes 121 of them.
_LIBRARY = torch.library.Library("snapkv", "DEF")
_LIBRARY.define("packed_linear(Tensor x, int handle, int out_features, Tensor? bias) -> Tensor")


def _packed_linear(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for the packed weight registered under ``handle``: oneDNN's call, as eager makes it."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED_WEIGHTS[handle].packed, bias, "none", [], "")


def _packed_linear_shape(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


_LIBRARY.impl("packed_linear", _packed_linear, "CPU")
torch.library.register_fake("snapkv::packed_linear", _packed_linear_shape, lib=_LIBRARY)
packed_linear_op = torch.ops.snapkv.packed_linear


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
        self.handle = next(_HANDLES)
        _PACKED_WEIGHTS[self.handle] = self

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
        return self.packed_product(x)

    def packed_product(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear_op(x, self.handle, self.out_features, self.bias)
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


class FusedLinears:
    """One weight for sibling layers that read the same input: the rows of each, stacked.

    Each sibling becomes a :class:`FusedMember`. The first member called with an input computes
    every sibling's output in one product; the others take their columns of it while the input is
    the same tensor. The shared product is held per thread until every member has taken its part.
    ``product``: the stacked layer when the caller built it (int8 weights,
    :func:`snapkv_rag.model.quantization.fuse_int8_siblings`); by default the siblings' weights are
    stacked and packed for oneDNN.
    """

    def __init__(self, linears: Sequence[Any], product: Any = None):  # nn.Linear, PackedLinear or Int8Linear layers
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("fused layers need a bias on all of them or on none")
        if product is None:
            weights = [m.weight.detach() for m in linears]
            if len({w.shape[1] for w in weights}) != 1 or len({w.dtype for w in weights}) != 1:
                raise ValueError("fused layers need one input width and one dtype")
            stacked = nn.Linear(weights[0].shape[1], sum(w.shape[0] for w in weights), bias=biases[0] is not None, dtype=weights[0].dtype)
            with torch.no_grad():
                stacked.weight.copy_(torch.cat(weights))
                if stacked.bias is not None:
                    stacked.bias.copy_(torch.cat([b.detach() for b in biases if b is not None]))
            product = PackedLinear(stacked)
        self.packed: Any = product
        self.dtype: torch.dtype = product.dtype
        self.bytes_per_weight = product.packed.element_size() if isinstance(product, PackedLinear) else product.qweight.element_size()
        self.bounds: list[tuple[int, int]] = []
        start = 0
        for m in linears:
            self.bounds.append((start, start + m.out_features))
            start += m.out_features
        self._local = threading.local()
        self._traced: tuple[torch.Tensor, torch.Tensor, list[int]] | None = None

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        start, stop = self.bounds[index]
        if torch.compiler.is_compiling():
            # traced once per graph: a plain attribute, None again when the last member took its part
            held = self._traced
            if held is None or held[0] is not x:
                held = self._traced = (x, self._product(x), [])
            held[2].append(index)
            if len(held[2]) == len(self.bounds):
                self._traced = None
            return held[1][..., start:stop]
        local = self._local
        served = getattr(local, "served", None)
        if getattr(local, "x", None) is not x or served is None or index in served:
            # the identity check is safe: the held reference keeps x's id from being reused
            local.x, local.out, served = x, self._product(x), set()
            local.served = served
        out = local.out
        served.add(index)
        if len(served) == len(self.bounds):
            local.x = local.out = local.served = None
        return out[..., start:stop]

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.packed_product(x) if isinstance(self.packed, PackedLinear) else self.packed(x)


class FusedMember(PackedLinear):
    """One layer of a :class:`FusedLinears` group: its rows of the stacked weight."""

    def __init__(self, group: FusedLinears, index: int, linear: nn.Linear | PackedLinear):
        nn.Module.__init__(self)
        self.group = group  # not a submodule: the members share it
        self.index = index
        self.copy_of_tied_weight = False
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = group.dtype
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:
        start, stop = self.group.bounds[self.index]
        return self.group.packed.weight[start:stop].contiguous()

    @property
    def packed_bytes(self) -> int:
        return self.in_features * self.out_features * self.group.bytes_per_weight

    def packed_product(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)

    def extra_repr(self) -> str:
        start, stop = self.group.bounds[self.index]
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=onednn, fused rows {start}:{stop}"


def sibling_groups(model: nn.Module, layers: Sequence[tuple[str, nn.Module]]) -> list[list[str]]:
    """Names of ``layers`` that read one input tensor inside one parent module, found by running
    ``model`` on two tokens (groups of two or more, in call order; [] if that forward fails)."""
    inputs: dict[str, int] = {}
    keep: list[torch.Tensor] = []  # hold the inputs, so no two of them share an id

    def recorder(name: str):
        def record(_module, args):
            if name not in inputs and args and isinstance(args[0], torch.Tensor):
                inputs[name] = id(args[0])
                keep.append(args[0])

        return record

    handles = [module.register_forward_pre_hook(recorder(name)) for name, module in layers]
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([[0, 1]]), use_cache=False)
    except Exception:  # a model that cannot run bare token ids keeps its layers apart
        return []
    finally:
        for handle in handles:
            handle.remove()
    groups: dict[tuple[str, int], list[str]] = {}
    for name in inputs:  # dicts keep insertion order: call order
        groups.setdefault((name.rpartition(".")[0], inputs[name]), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def fuse_sibling_linears(model: nn.Module) -> int:
    """Pack sibling :class:`PackedLinear` layers that read the same input as one weight
    (:class:`FusedLinears`); returns how many groups were made."""
    layers = [(name, m) for name, m in packed_layers(model) if type(m) is PackedLinear and not m.copy_of_tied_weight]
    by_name = dict(layers)
    fused = 0
    for names in sibling_groups(model, layers):
        members = [by_name[n] for n in names]
        try:
            group = FusedLinears(members)
        except ValueError:
            continue
        for index, (name, linear) in enumerate(zip(names, members)):
            replace_module(model, name, FusedMember(group, index, linear))
        fused += 1
    return fused


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model.get_submodule(name)`` is."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)


def pack_linear_weights(model: nn.Module, *, fuse: bool = True) -> int:
    """Replace every plain CPU ``nn.Linear`` of ``model`` in a packable dtype by a
    :class:`PackedLinear`; returns how many were replaced (0 where oneDNN cannot pack them).
    ``fuse``: siblings that read one input share one packed weight (:func:`fuse_sibling_linears`)."""
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
    if fuse and targets:
        fuse_sibling_linears(model)
    return len(targets)


def packed_layers(model: nn.Module) -> list[tuple[str, PackedLinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear)]


def packed_weight_bytes(model: nn.Module) -> int:
    return sum(m.packed_bytes for _, m in packed_layers(model))


def packed_parameter_count(model: nn.Module) -> int:
    """The model's parameters that packed layers hold (a tied head's copy is not counted again)."""
    return sum(m.in_features * m.out_features for _, m in packed_layers(model) if not m.copy_of_tied_weight)


def weight_layout(model: nn.Module) -> str:
    """``"onednn-packed"`` where linear weights were packed (:func:`pack_linear_weights`),
    ``"onednn-packed+fused"`` where siblings share a packed weight too, else ``"plain"``."""
    layers = packed_layers(model)
    if not layers:
        return "plain"
    return "onednn-packed+fused" if any(isinstance(m, FusedMember) for _, m in layers) else "onednn-packed"


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
