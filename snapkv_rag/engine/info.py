"""What an engine runs: the model's shape, dtype, device and weight format, its context length,
the width of its logits and its end-of-sequence tokens."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..model.packed_linear import weight_layout
from ..model.quantization import weight_format


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_type: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    context_length: int | None
    dtype: str
    device: str
    parameters: int
    weights: str = "native"
    weight_layout: str = "plain"
    adapter: str | None = None  # the LoRA adapter merged at load (its directory), None for the bare model
    invariant: bool = False  # the engine's invariant mode (snapkv_rag.engine.invariant): greedy output independent of reuse and batching
    compiled_decode: str = "off"  # "on": batches decode through the compiled step (snapkv_rag.engine.compiled_decode), else why not

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, in the model's dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kv_bytes_per_token": self.kv_bytes_per_token}


def context_length(model) -> int | None:
    """The most positions the model was trained for (None when its config does not say)."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def model_info(model, name: str, parameters: int) -> ModelInfo:
    text = model.config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    return ModelInfo(
        name=name,
        model_type=text.model_type,
        num_layers=text.num_hidden_layers,
        num_query_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        context_length=context_length(model),
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(next(model.parameters()).device),
        parameters=parameters,
        weights=weight_format(model),
        weight_layout=weight_layout(model),
        adapter=getattr(model, "snapkv_adapter", None),
    )


def vocab_size(model) -> int:
    """Rows of the output embedding: the width of the logits (may exceed the tokenizer's)."""
    out = model.get_output_embeddings()
    if out is not None:
        return getattr(out, "out_features", None) or out.weight.shape[0]
    return model.config.get_text_config(decoder=True).vocab_size


def eos_token_ids(model, tokenizer) -> frozenset[int]:
    """Every end-of-sequence id the generation config, the model config and the tokenizer name."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)
