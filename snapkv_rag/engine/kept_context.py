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

from ..reuse.kept_contexts import KeptContexts
from .generation import DecodeRun


def context_steps(
    run: DecodeRun, suffix: list[int], store: KeptContexts | None, spec: str, namespace: str, chunk_tokens: int | None
) -> Generator[None, None, torch.Tensor]:
    """``run`` (over the context's tokens) prefilled from the kept context or by reading it (then kept),
    then ``suffix`` read over it; yields between prefill chunks, returns the last logits ``[1, vocab]``."""
    context = run.rows[0]
    kept = store.get(context, spec, namespace) if store is not None else None
    if kept is not None:
        run.adopt(kept)
        run.context_reuse = "reused"
    else:
        yield from run.prefill_steps(chunk_tokens)
        if run.exited_early:
            return run.last_logits
        stored = store is not None and store.put(context, spec, run.kept_context(), namespace)
        run.context_reuse = "stored" if stored else "read (larger than the kept-context bound)"
    yield
    return run.continue_prompt(suffix)
