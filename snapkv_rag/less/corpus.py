"""Offline training and held-out text for LESS: the Python Language Reference topics.

Source: ``pydoc_data.topics`` of the running Python's standard library (the text ``help()``
shows for keywords and topics, taken from the Python documentation), licensed under the
PSF License Agreement (Python Software Foundation License Version 2), which permits
use, reproduction and derivative works. It ships with every CPython, so it is always
there offline.

Topics are split by a stable hash of their name into a training part and a disjoint
held-out part (about one topic in five), each concatenated in sorted topic order.
"""

from __future__ import annotations

import hashlib

from ..errors import LessTrainingError

SOURCE = "pydoc_data.topics (Python Language Reference topics, CPython standard library)"
LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
HELDOUT_EVERY = 5


def split_of(topic: str) -> str:
    digest = int(hashlib.sha256(topic.encode()).hexdigest(), 16)
    return "heldout" if digest % HELDOUT_EVERY == 0 else "train"


def corpus_text(split: str) -> str:
    """All topics of ``split`` ("train" or "heldout"), separated by blank lines."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics) if split_of(name) == split)


def corpus_tokens(tokenizer, split: str) -> list[int]:
    """The split's text as token ids (no special tokens)."""
    return list(tokenizer(corpus_text(split), add_special_tokens=False)["input_ids"])


def windows(tokens: list[int], length: int, count: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``length`` tokens (at most ``count``)."""
    out = [tokens[i : i + length] for i in range(0, len(tokens) - length + 1, length)]
    return out if count is None else out[:count]


def validation_tail(val: int, prompt_lengths: list[int], continuation_tokens: int) -> int:
    """Tokens at the end of the training split that hold the validation windows of every prompt
    length (room for ``val`` windows of the longest); both training stages use the same tail."""
    return val * (max(prompt_lengths) + continuation_tokens)


def overlapping_windows(tokens: list[int], length: int, train: int, val: int, tail: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """``train`` windows spread evenly over the text before the last ``tail`` tokens (default
    ``val * length``; training on several window lengths passes the longest length's tail to
    every length, so no training window of any length reaches a validation window), and
    ``val`` non-overlapping windows at the start of that tail."""
    tail = val * length if tail is None else tail
    if tail < val * length:
        raise LessTrainingError(f"a validation tail of {tail} tokens cannot hold {val} windows of {length}")
    start = len(tokens) - tail
    if start < length:
        raise LessTrainingError(f"the training split ({len(tokens)} tokens) is too short for windows of {length} before a {tail}-token validation tail")
    val_windows = windows(tokens[start:], length, val)
    stride = max(1, (start - length) // max(1, train - 1))
    train_windows = [tokens[s : s + length] for s in range(0, start - length + 1, stride)][:train]
    return train_windows, val_windows
