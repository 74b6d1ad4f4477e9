"""Needle-in-a-haystack prompts: a fact hidden at a chosen depth of filler text of a chosen length.

Two wordings: ``passkey`` (the default, a 5-digit pass key in sentences about grass and sky) and
``code`` (a 4-digit door code in sentences about a harbour town), which no prompt, test or
training example of the project uses otherwise: a reading that finds only the first has learnt
its wording, not to read.
"""

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
class NeedleWording:
    head: str  # opens the user message
    needle: str  # the sentence holding the fact, ``{answer}`` in it
    question: str
    filler: tuple[str, ...]
    digits: int


NEEDLE_WORDINGS = {
    # This wording was the one SmolLM2-135M answered at every depth of 1K and 2K haystacks
    # uncompressed; vaguer ones failed near the start, which would blame compression for the model.
    "passkey": NeedleWording("Read the text and find the pass key.", "\nIMPORTANT: the pass key is {answer}.\n", "what is the pass key?", FILLER_SENTENCES, 5),
    "code": NeedleWording(
        "The notes below mention a door code.",
        "\nThe code that opens the red door is {answer}.\n",
        "which code opens the red door?",
        ("Boats rest in the harbour.", "A gull calls over the pier.", "Nets dry on the wall.", "The tide goes out at noon."),
        4,
    ),
}


@dataclass(frozen=True)
class NeedleCase:
    prompt: str  # the user message: haystack with the needle, then the question
    answer: str
    depth: float  # 0 = start of the haystack, 1 = end
    target_tokens: int
    seed: int
    haystack: str = ""  # the text the needle hides in, needle included
    question: str = ""  # the question alone, as a document reader would ask it


def make_passkey(seed: int, digits: int = 5) -> str:
    rng = random.Random(seed)
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def build_needle_case(
    tokenizer, target_tokens: int, depth: float, *, seed: int = 0, digits: int | None = None, wording: str = "passkey", varied: bool = False
) -> NeedleCase:
    """A haystack of about ``target_tokens`` tokens (the whole user message) with a fact at
    ``depth``, worded per :data:`NEEDLE_WORDINGS` (``digits``: its own by default). ``varied``:
    each repeat of the filler has its sentences in its own (seeded) order, so no two stretches of
    the haystack are the same text (a document store keeps one copy of repeated chunks)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if wording not in NEEDLE_WORDINGS:
        raise ValueError(f"wording must be one of {sorted(NEEDLE_WORDINGS)}, got {wording!r}")
    words = NEEDLE_WORDINGS[wording]
    answer = make_passkey(seed, digits or words.digits)
    needle = words.needle.format(answer=answer)
    question = f"\n\nQuestion: {words.question}"
    fixed = len(tokenizer(words.head + needle + question, add_special_tokens=False)["input_ids"])
    filler_unit = " " + " ".join(words.filler)
    unit_tokens = len(tokenizer(filler_unit, add_special_tokens=False)["input_ids"])
    units = max(1, round((target_tokens - fixed) / unit_tokens))
    at = round(units * depth)
    if varied:
        rng = random.Random(f"{seed}:filler")
        fill = ["".join(" " + s for s in rng.sample(words.filler, len(words.filler))) for _ in range(units)]
    else:
        fill = [filler_unit] * units
    haystack = "".join(fill[:at]) + needle + "".join(fill[at:])
    return NeedleCase(
        prompt=words.head + haystack + question,
        answer=answer,
        depth=depth,
        target_tokens=target_tokens,
        seed=seed,
        haystack=haystack.strip(),
        question=words.question[0].upper() + words.question[1:],
    )
