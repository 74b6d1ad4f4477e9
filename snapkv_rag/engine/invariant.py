"""The invariant mode: a greedy request's tokens, bit for bit, whatever else happens to the engine.

Without it, how a request is computed depends on its circumstances, and in bf16 (the default on
GPUs and CPUs that compute it) each way rounds differently: a prompt reused from the prefix cache
attends to the stored keys in two pieces where a cold one attends in one; a batch pads its rows
and runs one forward for all; a prompt arriving while others decode is prefilled in chunks; a
drafted step computes several tokens in one forward. Each changes a few logits in their last
bits, and a greedy choice between near-tied tokens then flips, so "the same question gives another
answer the second time". In fp32 the differences are as small, but rarely decide a token.

In the invariant mode every computation has one shape, whatever the circumstances:

- **Prefill in position-aligned chunks.** The prompt runs in forwards of ``invariant_chunk_tokens``
  tokens at positions ``0, C, 2C, ...``, then one last forward over the rest (at least the
  policy's observation window, where the compression selects). A stored prefix is reused only
  in whole chunks of a prompt that was itself computed so, in chunks of the same size
  (``PrefixEntry.aligned`` and ``PrefixEntry.chunk``): the reused keys are the bytes a cold
  prefill would compute, and the remaining chunks run on the same inputs, so a reused prompt and a
  cold one end in the same cache and the same logits. Being exact in every dtype, that reuse starts
  at ``MIN_REUSE_SHARE`` of the prompt in bf16 too, and the ``"repeat"`` admission stores by the
  same rule (``reuse.prefix_cache.whole_chunks``).
- **One prompt per prefill, one row per decode forward.** ``generate_batch`` prefills its rows
  one by one, and every request decodes on its own cache in its own forward (the scheduler's
  solo groups), so no row's arithmetic sees another's padding or length; the chunking does not
  change when other requests are running.
- **No multi-token decode forwards.** Prompt-lookup drafts are off (``stats.drafts`` says so),
  and blended chunk reuse, which approximates by design, is refused (``stats.segment_reuse``).

What it does not promise: the same tokens on another machine, another dtype, another thread
count or another torch version (kernels differ); sampled tokens beyond what the seed fixes; and
policies that need every prompt query (H2O) or models with sliding-window layers are prefilled
whole, which is invariant too, but they never reuse a prefix. The cost is measured in
eval/decoding/RESULTS.md ("The invariant mode"). ``SNAPKV_RAG_INVARIANT=1`` turns it on for the
engines a process creates; the eval harness (``snapkv-rag eval``) always runs with it.
"""

from __future__ import annotations

import os

ENVIRONMENT = "SNAPKV_RAG_INVARIANT"
#: Tokens per prefill forward in the invariant mode (a reused prefix is rounded down to a multiple).
DEFAULT_INVARIANT_CHUNK = 256


def invariant_from_environment() -> bool:
    return os.environ.get(ENVIRONMENT, "").strip().lower() in ("1", "true", "yes", "on")


def checked_invariant_chunk(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 16:
        raise ValueError(f"invariant_chunk_tokens must be an integer >= 16, got {value!r}")
    return value
