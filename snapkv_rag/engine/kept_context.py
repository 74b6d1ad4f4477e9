"""Compress once, ask many: a prompt's context read without its question, kept, and asked again.

With ``keep_context=True`` a run reads its prompt in two parts. The context (everything before the
question, :func:`~snapkv_rag.engine.preparation.context_split`) is prefilled and compressed alone, by
the usual prefill (chunks, rolling, prefix reuse), so what the policy keeps cannot depend on the
question; the compressed cache is then kept (:class:`~snapkv_rag.reuse.kept_contexts.KeptContexts`).
The question and the template's tail are read over it at the positions after the context, and the run
decodes as any other. The next prompt over the same context tokens, policy and namespace starts from
a copy of the kept cache and reads only its question.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from ..compression.base import CompressionPolicy
from ..compression.kvzip import REPEAT_PROMPT, KVzip, RepeatScores
from ..model.device_clock import device_clock
from ..reuse.kept_contexts import KeptContexts
from .generation import DecodeRun


def repeat_steps(run: DecodeRun, policy: KVzip, repeat: list[int]) -> Generator[None, None, None]:
    """Score ``run``'s whole context by the model's repeat of it, a chunk per forward, and cut the cache to the policy's choice."""
    context = run.rows[0]
    scores = RepeatScores(policy, len(context), run.sliding)
    for start in range(0, len(context), policy.repeat_chunk):
        began = device_clock(run.device)
        run.listen(repeat + context[start : start + policy.repeat_chunk], scores)
        run.timings.prefill_seconds += device_clock(run.device) - began
        yield
    scores.shrink(run.cache)
    run.record_kept()


def context_steps(
    run: DecodeRun,
    policy: CompressionPolicy,
    suffix: list[int],
    cut: CompressionPolicy | None,
    store: KeptContexts | None,
    namespace: str,
    chunk_tokens: int | None,
    tokenizer,
) -> Generator[None, None, torch.Tensor]:
    """``run`` (over the context's tokens) prefilled from the kept context or by reading it under ``policy``
    (then kept), then ``suffix`` read over it, and the whole cut by ``cut`` with the question's window where
    given; yields between prefill chunks, returns the last logits ``[1, vocab]``. A KVzip context is
    prefilled whole (``run`` has no policy) and then cut by its repeat."""
    spec = policy.spec()
    context = run.rows[0]
    kept = store.get(context, spec, namespace) if store is not None else None
    if kept is not None:
        run.adopt(kept)
        run.context_reuse = "reused"
        if len(kept.tokens) < len(context):  # a kept start: read the rest whole, keep the longer context
            run.continue_prompt(context[len(kept.tokens) :])
            yield
            run.context_reuse = "extended" if store is not None and store.put(context, spec, run.kept_context(), namespace) else "reused"
    else:
        yield from run.prefill_steps(chunk_tokens)
        if run.exited_early:
            return run.last_logits
        if isinstance(policy, KVzip):
            yield from repeat_steps(run, policy, tokenizer.encode(REPEAT_PROMPT, add_special_tokens=False))
        if store is None:
            run.context_reuse = "read (the engine keeps no contexts: kept_contexts bound 0)"
        elif store.put(context, spec, run.kept_context(), namespace):
            run.context_reuse = "stored"
        else:
            run.context_reuse = "read (larger than the kept-context bound)"
    yield
    return run.continue_prompt(suffix, cut)
