"""A run over token ids through the engine, for the harness, the trainers and the benchmarks.

What they used to build as a :class:`~.generation.DecodeRun` on their own thread: teacher-forced
logits through a (compressed) cache, the prefill's logits, timed decode steps, and what the read kept.
Every model call here runs on the engine's worker (:meth:`~.engine.Engine.run_on_model`), so it never
overlaps a decode step and keeps the scheduler's OpenMP handling; no caller touches a private field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..compression import CompressionPolicy, as_policy
from .generation import DecodeRun
from .sampling import GenerationParams


class TokenRun:
    """One prompt of token ids read under a policy (resolved: a question window takes its paper default of 32
    unless the caller resolved it with ``policy.for_prompt``); make it with :meth:`Engine.token_run`."""

    def __init__(self, engine: Any, prompt_ids: Sequence[int], compression: CompressionPolicy | str | None, max_new_tokens: int, prefix_cache: bool):
        if not prompt_ids:
            raise ValueError("a token run needs a non-empty prompt")
        policy = as_policy(compression)
        if policy is not None and policy.needs_question_span:
            policy = policy.for_prompt(None)
        self._engine = engine
        self._run = DecodeRun(
            engine.model,
            [list(prompt_ids)],
            GenerationParams(max_new_tokens=max(1, max_new_tokens)),
            policy,
            engine._pad_id,
            prefix_cache=engine._prefix_cache_for(prefix_cache),
            invariant_chunk=engine._invariant_chunk,
        )

    def teacher_force(self, continuation: Sequence[int], *, train: bool = False) -> torch.Tensor:
        """Logits ``[len(continuation), vocab]`` predicting each token of ``continuation`` (row 0 from the
        prefill). ``train=True``: the continuation's forward keeps gradients (the prefill never does)."""
        ids = list(continuation)
        return self._engine.run_on_model(lambda: self._run.teacher_force(ids, train=train))

    def prefill_logits(self) -> torch.Tensor:
        """The prefill's logits for the next token, ``[1, vocab]``."""
        return self._engine.run_on_model(self._run.prefill)

    def decode(self) -> dict[str, Any]:
        """Run every decode step (``max_new_tokens``); the timings and the policy's stats."""

        def steps() -> None:
            for _ in self._run.steps():
                pass

        self._engine.run_on_model(steps)
        return {"decode_ms_per_token": self._run.timings.decode_ms_per_token, **self.policy_stats()}

    @property
    def kept_tokens_per_layer(self) -> list[int]:
        return list(self._run.kept_tokens_per_layer)

    @property
    def prompt_kv_bytes_kept(self) -> int:
        return self._run.prompt_kv_bytes_kept

    def policy_stats(self) -> dict[str, Any]:
        return self._run.policy_stats()
