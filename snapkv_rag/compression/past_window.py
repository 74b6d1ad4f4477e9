"""The one rule for a prompt longer than the model's window: whether it is read rolled, and in what chunks.

A sparse policy can read any prompt ``rolling=N`` tokens at a time (:mod:`snapkv_rag.engine.rolling`);
the full cache cannot read past the window at all. The engine asks :func:`fit_to_window` for every
call, so every interface (DocumentQA, the skim, the app, the server, both connectors) reads such a
prompt alike; they ask :func:`reads_past_window` to tell a user or size a budget in advance.
"""

from __future__ import annotations

from .base import MIN_ROLLING, CompressionPolicy

ROLLING_CHUNK = 1024  # tokens a prompt past the window is read at a time, unless the policy names its own


def can_roll(policy: CompressionPolicy | None) -> bool:
    """Whether ``policy`` can read a prompt past the window (None, the full cache and LESS cannot)."""
    return policy is not None and policy.can_roll


def past_window(prompt_tokens: int, new_tokens: int, context_length: int | None) -> bool:
    """Whether the prompt plus the answer exceed the model's window (None: no known window)."""
    return context_length is not None and prompt_tokens + new_tokens > context_length


def reads_past_window(policy: CompressionPolicy | None, prompt_tokens: int, new_tokens: int, context_length: int | None) -> bool:
    """Whether such a prompt does not fit the window and ``policy`` reads it anyway, rolled."""
    return past_window(prompt_tokens, new_tokens, context_length) and can_roll(policy)


def fit_to_window(
    policy: CompressionPolicy | None,
    prompt_tokens: int,
    new_tokens: int,
    context_length: int | None,
    *,
    chunk: int = ROLLING_CHUNK,
    always: bool = False,
) -> CompressionPolicy | None:
    """``policy`` as a prompt of ``prompt_tokens`` is read with, answering ``new_tokens``.

    Unchanged when it fits the window (unless ``always``), when the policy names its own ``rolling=``,
    or when it cannot roll (the engine then refuses a prompt past the window). Else rolled in
    ``chunk``-token pieces, fewer where budget + chunk + window + answer would not fit the window
    either (as given when not even :data:`~.base.MIN_ROLLING` would).
    """
    if not can_roll(policy) or policy.rolling is not None:  # type: ignore[union-attr]
        return policy
    if not always and not past_window(prompt_tokens, new_tokens, context_length):
        return policy
    assert policy is not None
    room = chunk if context_length is None else min(chunk, context_length - policy.max_capacity_prompt - policy.window_bound - new_tokens)
    return policy.with_rolling(room) if room >= MIN_ROLLING else policy
