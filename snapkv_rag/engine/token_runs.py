"""A run over token ids through the engine, for the harness, the trainers and the benchmarks.

What they used to build as a :class:`~.generation.DecodeRun` on their own thread: teacher-forced
logits through a (compressed) cache, the prefill's logits, timed decode steps, and what the read kept.
Every model call here runs on the engine's worker (:meth:`~.engine.Engine.run_on_model`), so it never
overlaps a decode step and keeps the scheduler's OpenMP handling; no caller touches a private field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


# ------------------------------------------------------------------ trainers
# A trainer owns the model it trains (no engine serves it meanwhile) and needs gradients, which the
# engine's worker (under inference mode) does not keep: these run the engine's decode path on the
# caller's thread, for training only.


def teacher_force_for_training(model, prompt_ids: Sequence[int], continuation: Sequence[int], policy: CompressionPolicy | None, pad_id: int) -> torch.Tensor:
    """Logits ``[len(continuation), vocab]`` of ``continuation`` read through the cache ``policy`` keeps of
    ``prompt_ids``: the prefill without gradients, the continuation's forward with them (the LoRA tuner's reads)."""
    run = DecodeRun(model, [list(prompt_ids)], GenerationParams(max_new_tokens=len(continuation)), policy, pad_id)
    return run.teacher_force(list(continuation), train=True)


def logits_after_recorded_prefill(
    model,
    pad_id: int,
    tokens: Sequence[int],
    policy: CompressionPolicy,
    policy_state: Callable[[Any, torch.device, list[bool]], Any],
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[c-1, vocab]`` over the continuation ``tokens[n:]`` after a compressed prefill rebuilt from a
    recording instead of run: every layer's prompt ``keys``/``values`` ``[layers, kv_heads, n, head_dim]`` and
    the selection ``kept`` ``[layers, kv_heads, k]`` go into the cache through ``policy_state(policy, device,
    sliding)`` (the state that folds what is evicted, e.g. LESS's), then the continuation runs at its true
    positions through the decode path, differentiable in that state (LESS's stage-2 kernels)."""
    from ..compression.runtime import PrefillCompression

    n = keys.shape[2]
    prompt, continuation = list(tokens[:n]), list(tokens[n:])
    run = DecodeRun(model, [prompt], GenerationParams(max_new_tokens=len(continuation)), policy, pad_id)
    run.policy_state = policy_state(policy, run.device, run.sliding)
    session = PrefillCompression(policy, run.cache, None, run.sliding, run.policy_state)
    dtype = model.dtype
    for layer_idx in range(keys.shape[0]):
        run.cache.update(keys[layer_idx][None].to(run.device, dtype), values[layer_idx][None].to(run.device, dtype), layer_idx)
        session.keep(layer_idx, kept[layer_idx][None].to(run.device).long())
    run._last_position = torch.tensor([[n - 1]], device=run.device)
    return run._extend(torch.tensor([continuation[:-1]], device=run.device), last_only=False)[0]
