"""LESS: a sparse base policy whose evicted entries are folded into a learned low-rank state.

Dong et al., "Get More with LESS: Synthesizing Recurrence with KV Cache Compression for
Efficient LLM Inference", ICML 2024, arXiv:2402.09398. See :mod:`snapkv_rag.less_training`.

Selection is the base policy's; the engine folds what it evicts into the state
(:class:`snapkv_rag.compression.less.state.LowRankState`) and the registered attention function merges
the state into every later step. ``kernels``: a kernel file path, a loaded
:class:`~snapkv_rag.compression.less.kernels.LessKernels`, or None for the shipped kernels that match
the model, the base policy's name and its budget.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ...errors import InvalidCompressionError
from ..base import CompressionPolicy
from ..snapkv import SnapKV


@dataclass(frozen=True)
class LESS(CompressionPolicy):
    name = "less"
    base: CompressionPolicy = field(default_factory=lambda: SnapKV(max_capacity_prompt=256))
    kernels: Any = None  # str path | LessKernels | None (shipped)
    # the prompt's last queries that check each head's state at prefill; heads it makes worse
    # for them are switched off (:meth:`~snapkv_rag.compression.less.state.LowRankState.check_heads`); 0: off
    probe: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.base, CompressionPolicy) or isinstance(self.base, LESS):
            raise InvalidCompressionError(f"LESS: base must be a sparse policy, got {self.base!r}")
        if self.base.ragged_heads:
            raise InvalidCompressionError("LESS: its state needs the same entries in every head; per-head budgets (heads=adaptive) do not combine with it")
        if self.base.max_capacity_prompt is None:
            raise InvalidCompressionError("LESS: the base policy must have a budget (not full)")
        if getattr(self.base, "rolling", None) is not None:
            raise InvalidCompressionError("LESS over a rolling base (rolling=) is not supported: its state would fold entries at positions that move")
        if not isinstance(self.probe, int) or self.probe < 0:
            raise InvalidCompressionError(f"LESS: probe must be a whole number >= 0 (prompt queries that check each head), got {self.probe!r}")

    @property
    def max_capacity_prompt(self) -> int:  # type: ignore[override]
        return self.base.max_capacity_prompt

    @property
    def query_window(self):
        return self.base.query_window

    @property
    def needs_question_span(self) -> bool:
        return self.base.needs_question_span

    def for_prompt(self, question_tokens):
        return dataclasses.replace(self, base=self.base.for_prompt(question_tokens))

    @property
    def question_aware(self) -> bool:
        return self.base.question_aware

    def for_layer(self, position: int, layers: int) -> LESS:
        return dataclasses.replace(self, base=self.base.for_layer(position, layers))

    def with_budget(self, budget: int) -> LESS:
        return dataclasses.replace(self, base=self.base.with_budget(budget))

    def with_bits(self, bits: int | None) -> LESS:
        return dataclasses.replace(self, base=self.base.with_bits(bits))

    def with_settings(self, **settings: Any) -> LESS:
        return dataclasses.replace(self, base=self.base.with_settings(**settings))

    @property
    def reads_values(self) -> bool:
        return self.base.reads_values

    @property
    def needs_rotary_angles(self) -> bool:
        return self.base.needs_rotary_angles

    def select(self, queries, keys, attention_mask=None, *, scaling=None, protected=None, **values):
        return self.base.select(queries, keys, attention_mask, scaling=scaling, protected=protected, **values)

    @property
    def decode_budget(self) -> int | None:  # type: ignore[override]
        return self.base.decode_budget

    @property
    def decode_interval(self) -> int | None:  # type: ignore[override]
        return self.base.decode_interval

    @property
    def kv_bits(self) -> int | None:  # type: ignore[override]
        """The base's stored width: the kept entries are quantized, the low-rank state stays full width."""
        return self.base.kv_bits

    def decode_state(self, model, sliding):
        """The low-rank state every eviction of the run (prefill and decode-time) is folded into."""
        from .state import LessPolicyState, LowRankState

        device = next(model.parameters()).device
        return LessPolicyState(LowRankState(self.load_kernels(model), device, self.probe), self.base, sliding)

    def kernels_label(self) -> str:
        if self.kernels is None:
            return "shipped"
        if isinstance(self.kernels, str):
            return self.kernels
        return "in-memory"

    def settings(self) -> dict[str, Any]:
        return {
            "method": self.name,
            "max_capacity_prompt": self.max_capacity_prompt,
            "base": self.base.settings(),
            "kernels": self.kernels_label(),
            "probe": self.probe,
            "question_aware": self.question_aware,
        }

    def spec(self) -> str:
        fields = ",".join(f"{k}={v}" for k, v in self.base.spec_fields().items())
        spec = f"less:base={self.base.name}" + (f",{fields}" if fields else "")
        spec += f",probe={self.probe}" if self.probe else ""
        return spec + (f",kernels={self.kernels}" if isinstance(self.kernels, str) else "")

    def load_kernels(self, model):
        """The kernels for ``model``: the given ones, checked against it, or the matching shipped file."""
        from .kernels import LessKernels, find_shipped, load_kernels, model_signature

        signature = model_signature(model)
        if isinstance(self.kernels, LessKernels):
            self.kernels.check_model(signature, "the given kernels")
            return self.kernels
        path = self.kernels if self.kernels is not None else find_shipped(signature, self.base.name, self.max_capacity_prompt)
        kernels = load_kernels(path)
        kernels.check_model(signature, str(path))
        return kernels
