"""What a compressed prefill kept of each stuffed document.

The numbered documents of a :class:`StuffedContext` are located in the rendered prompt (token
spans of each ``[n] title / text`` block), and the kept positions recorded by
:func:`snapkv_rag.compression.recording_kept_indices` are summed over each span. The result
says, per document, how many of its KV entries survived compression on average over layers
and KV heads, so a reader sees whether a cited document was kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compression.runtime import KeptIndices
from ..engine.prompts import render_prompt
from .stuffing import StuffedContext, format_document


@dataclass(frozen=True)
class DocumentKept:
    number: int  # the document's number in the prompt, [number]
    tokens: int  # LLM tokens of its block in the prompt
    kept: float  # entries kept of those tokens, averaged over compressed layers and KV heads

    @property
    def share(self) -> float:
        return self.kept / self.tokens if self.tokens else 0.0


def document_spans(tokenizer, context: StuffedContext) -> list[tuple[int, int]]:
    """``[start, end)`` token positions of each numbered document in the prompt the engine renders.

    Raises ``ValueError`` when a document's text cannot be found in the rendered prompt
    (a chat template that rewrites message content).
    """
    text = tokenizer.apply_chat_template(context.messages, tokenize=False, add_generation_prompt=True)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    # render_prompt may add or drop a BOS at the front; count positions from the end.
    shift = len(render_prompt(tokenizer, context.messages)) - len(offsets)
    spans: list[tuple[int, int]] = []
    cursor = 0
    first = 0
    for number, chunk in enumerate(context.chunks, start=1):
        block = format_document(number, chunk)
        start = text.find(block, cursor)
        if start < 0:
            raise ValueError(f"document [{number}] is not verbatim in the rendered prompt")
        end = start + len(block)
        cursor = end
        while first < len(offsets) and offsets[first][1] <= start:
            first += 1
        last = first
        while last < len(offsets) and offsets[last][0] < end:
            last += 1
        spans.append((first + shift, last + shift))
        first = last
    return spans


def kept_per_document(tokenizer, context: StuffedContext, kept: KeptIndices | None, *, row: int = 0) -> list[DocumentKept]:
    """Per stuffed document: its prompt tokens and the entries kept of them (None: full cache)."""
    spans = document_spans(tokenizer, context)
    if kept is None:
        return [DocumentKept(i, e - s, float(e - s)) for i, (s, e) in enumerate(spans, start=1)]
    share = kept.share(row)
    if spans and spans[-1][1] > share.shape[0]:
        raise ValueError(f"the record covers {share.shape[0]} prompt positions, the documents reach {spans[-1][1]}")
    return [DocumentKept(i, e - s, float(share[s:e].sum())) for i, (s, e) in enumerate(spans, start=1)]
