"""Attributed citations: which stuffed chunks support each sentence of an answer.

Small models answer from short contexts but rarely write usable ``[n]`` markers, so the
toolkit attributes each answer sentence itself by evidence matching. Each chunk's score
for a sentence is the cosine similarity (the RAG embedder) between the chunk and the
question plus the sentence, plus the share of the sentence's content words found in the
chunk. The best chunk is cited when its score clears ``threshold``, together with any
chunk within ``margin`` of it. (Choice and numbers: eval/RESULTS.md, "Citations".)
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from .embeddings import Embedder

METHODS = ("hybrid", "embedding", "lexical")
_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+(?=\s|$)|$)|[^.!?\n]*[.!?]+")
_WORD = re.compile(r"[\w][\w'\-:.]*[\w]|\w")
_MARKER = re.compile(r"\[\s*\d+(?:\s*[,;]\s*\d+)*\s*\]")
STOPWORDS = frozenset(
    """a an the and or but if of to in on at by for with from as is are was were be been being it its this that these
    those there here what which who whom whose when where why how do does did done has have had not no yes so than then
    too very can could will would shall should may might must i you he she we they me him her us them my your his our
    their about into over under after before during between also only just more most some any each other such own same
    up down out off again further once all both few many much per via answer question document documents""".split()
)


@dataclass(frozen=True)
class SentenceSupport:
    sentence: str
    numbers: tuple[int, ...]  # 1-based document numbers in the prompt
    scores: tuple[float, ...]  # the score of each cited number


def split_sentences(text: str) -> list[str]:
    return [m.group(0).strip() for m in _SENTENCE.finditer(text) if len(m.group(0).strip()) > 1]


def content_words(text: str) -> set[str]:
    return {w.lower().strip(".:") for w in _WORD.findall(text) if w.lower() not in STOPWORDS and len(w) > 1}


def lexical_support(sentence: str, chunk_text: str) -> float:
    words = content_words(sentence)
    if not words:
        return 0.0
    return len(words & content_words(chunk_text)) / len(words)


class EvidenceAttributor:
    def __init__(self, embedder: Embedder, *, method: str = "hybrid", threshold: float | None = None, margin: float = 0.1):
        if method not in METHODS:
            raise ValueError(f"attribution method must be one of {METHODS}, got {method!r}")
        self.embedder = embedder
        self.method = method
        self.threshold = threshold if threshold is not None else {"hybrid": 0.6, "embedding": 0.3, "lexical": 0.3}[method]
        self.margin = margin

    def scores(self, question: str, sentences: Sequence[str], chunk_texts: Sequence[str]) -> list[list[float]]:
        """``[sentence][chunk]`` support scores."""
        lexical = [[lexical_support(s, c) for c in chunk_texts] for s in sentences]
        if self.method == "lexical":
            return lexical
        vectors = self.embedder.embed([f"{question} {s}" for s in sentences] + list(chunk_texts))
        queries, chunks = vectors[: len(sentences)], vectors[len(sentences) :]
        cosine = [[sum(a * b for a, b in zip(q, c)) for c in chunks] for q in queries]
        if self.method == "embedding":
            return cosine
        return [[cos + lex for cos, lex in zip(crow, lrow)] for crow, lrow in zip(cosine, lexical)]

    def attribute(self, question: str, answer: str, chunk_texts: Sequence[str]) -> list[SentenceSupport]:
        sentences = [s for s in (_MARKER.sub("", s).strip() for s in split_sentences(answer)) if content_words(s)]
        if not sentences or not chunk_texts:
            return []
        out = []
        for sentence, row in zip(sentences, self.scores(question, sentences, chunk_texts)):
            best = max(row)
            if best < self.threshold:
                out.append(SentenceSupport(sentence, (), ()))
                continue
            chosen = sorted((i for i, s in enumerate(row) if s >= best - self.margin), key=lambda i: -row[i])[:3]
            out.append(SentenceSupport(sentence, tuple(i + 1 for i in chosen), tuple(round(row[i], 4) for i in chosen)))
        return out
