"""The tuning data: a deterministic mix of document-QA and tool-decision examples, tokenized
exactly as the engine renders prompts.

``build_examples(seed, n, split)`` gives the same examples for the same arguments; the
``"heldout"`` split draws only held-out domains, tools and templates, which ``"train"`` never
draws (tests check the two are disjoint).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.prompts import render_prompt, segment_spans
from ..tools import build_output_spec
from .block_attention import block_attention_mask, with_anchor_copies
from .compressed_reads import CompressedReadGenerator
from .examples import Example
from .qa_data import QAGenerator
from .tool_data import ToolGenerator

SPLITS = ("train", "heldout")
QA_SHARE = 0.6
READ_SHARE = 0.5  # recipe 4: the share of the QA read through the compression
RECIPES = (3, 4)


def build_examples(
    seed: int, n: int, split: str = "train", *, count_tokens: Callable[[str], int] | None = None, qa_share: float = QA_SHARE, recipe: int = 3
) -> list[Example]:
    """Recipe 3: document QA over 0.5K-4K stuffed tokens read in full, and tool decisions. Recipe 4
    adds, as half of the QA, reads of 2K-16K tokens through the default compression
    (:mod:`.compressed_reads`), and near-miss requests that need no tool."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    # one stream per split, so the held-out examples do not depend on how many train ones were drawn
    rng = random.Random(f"{seed}:{split}")
    heldout = split == "heldout"
    qa, tools = QAGenerator(rng, heldout=heldout, count_tokens=count_tokens), ToolGenerator(rng, heldout=heldout, near_misses=recipe >= 4)
    if recipe < 4:
        return [(qa if rng.random() < qa_share else tools).example() for _ in range(n)]
    reads = CompressedReadGenerator(rng, heldout=heldout, count_tokens=count_tokens)
    drawn = (rng.random() for _ in range(n))
    return [(reads if r < qa_share * READ_SHARE else qa if r < qa_share else tools).example() for r in drawn]


def write_jsonl(path: Path, examples: Iterable[Example]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for e in examples:
            fh.write(json.dumps(e.to_dict()) + "\n")


def read_jsonl(path: Path) -> list[Example]:
    return [Example.from_dict(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Encoded:
    input_ids: torch.Tensor  # [1, n]
    labels: torch.Tensor  # [1, n]: -100 on the prompt
    spans: list[tuple[int, int]]  # stuffed chunks read apart; empty: plain causal
    prompt_tokens: int
    anchors: list[int] = field(default_factory=list)  # each span's anchor copy (block_attention.with_anchor_copies)
    position_ids: torch.Tensor | None = None  # [1, n] where anchor copies were inserted, else None (0..n-1)

    def attention_mask(self) -> torch.Tensor | None:
        return block_attention_mask(self.tokens, self.spans, self.anchors) if self.spans else None

    @property
    def tokens(self) -> int:
        return self.input_ids.shape[1]


def encode(example: Example, tokenizer) -> Encoded:
    """The prompt as the engine renders it (:func:`render_prompt`, tools included), then the
    target and the end-of-turn token; loss on the target only. An example with segments gets
    an anchor copy before each stuffed chunk (:func:`with_anchor_copies`), which only that
    chunk sees."""
    tools = build_output_spec(example.tools).tools if example.tools else ()
    prompt = render_prompt(tokenizer, example.messages, tools=tools)
    end = tokenizer.eos_token or ""
    answer = tokenizer(example.target + end, add_special_tokens=False)["input_ids"]
    spans = segment_spans(tokenizer, example.messages, example.segments, len(prompt), tools=tools) if example.segments else []
    if not spans:
        return Encoded(torch.tensor([prompt + answer]), torch.tensor([[-100] * len(prompt) + answer]), [], len(prompt))
    prompt, positions, spans, anchors = with_anchor_copies(prompt, spans)
    positions += range(positions[-1] + 1, positions[-1] + 1 + len(answer))
    ids, labels = torch.tensor([prompt + answer]), torch.tensor([[-100] * len(prompt) + answer])
    return Encoded(ids, labels, spans, len(prompt), anchors, torch.tensor([positions]))


def token_counter(tokenizer) -> Callable[[str], int]:
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def summarize(examples: Sequence[Example]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in examples:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    return dict(sorted(counts.items()))
