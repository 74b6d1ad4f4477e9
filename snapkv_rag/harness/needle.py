"""Needle-in-a-haystack prompts: a fact hidden at a chosen depth of filler text of a chosen length."""

from __future__ import annotations

import random
from dataclasses import dataclass

FILLER_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


@dataclass(frozen=True)
class NeedleCase:
    prompt: str  # the user message: haystack with the needle, then the question
    answer: str
    depth: float  # 0 = start of the haystack, 1 = end
    target_tokens: int
    seed: int


def make_passkey(seed: int, digits: int = 5) -> str:
    rng = random.Random(seed)
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def build_needle_case(tokenizer, target_tokens: int, depth: float, *, seed: int = 0, digits: int = 5) -> NeedleCase:
    """A haystack of about ``target_tokens`` tokens (the whole user message) with a passkey at ``depth``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    answer = make_passkey(seed, digits)
    # This wording was the one SmolLM2-135M answered at every depth of 1K and 2K haystacks
    # uncompressed; vaguer ones failed near the start, which would blame compression for the model.
    needle = f"\nIMPORTANT: the pass key is {answer}.\n"
    head = "Read the text and find the pass key."
    question = "\n\nQuestion: what is the pass key?"
    fixed = len(tokenizer(head + needle + question, add_special_tokens=False)["input_ids"])
    filler_unit = " " + " ".join(FILLER_SENTENCES)
    unit_tokens = len(tokenizer(filler_unit, add_special_tokens=False)["input_ids"])
    units = max(1, round((target_tokens - fixed) / unit_tokens))
    at = round(units * depth)
    haystack = filler_unit * at + needle + filler_unit * (units - at)
    return NeedleCase(prompt=head + haystack + question, answer=answer, depth=depth, target_tokens=target_tokens, seed=seed)
