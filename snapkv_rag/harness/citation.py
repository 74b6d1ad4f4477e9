"""Synthetic multi-document RAG collections with gold supporting documents per question.

Each document states one fact about a fictional company (made-up names, so the model
cannot answer from memory). Questions need one document ("In which city was X founded?")
or two ("In which cities were X and Y founded?"). The prompt numbers the documents, shows
one worked example turn that cites ``[n]``, then asks the question.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYLLABLES = ("ka", "lo", "mi", "ren", "tor", "vash", "bel", "dun", "sar", "pim", "quo", "zel", "fa", "nor", "gri", "tes")
CITIES = ("Lisbon", "Oslo", "Cairo", "Lima", "Hanoi", "Dublin", "Nairobi", "Quito", "Perth", "Riga", "Porto", "Turin", "Bergen", "Kyoto", "Austin", "Tunis")
PRODUCTS = ("bicycles", "lamps", "violins", "tea", "maps", "boats", "clocks", "soap", "kites", "gloves", "pianos", "honey")

SYSTEM = "You answer questions using only the numbered documents, and you cite the supporting document number in brackets, like [3]."


@dataclass(frozen=True)
class Document:
    number: int  # 1-based, as shown in the prompt
    company: str
    city: str
    year: int
    product: str

    @property
    def text(self) -> str:
        return f"{self.company} is a company that makes {self.product}. It was founded in {self.city} in {self.year}."


@dataclass(frozen=True)
class CitationQuestion:
    messages: list[dict[str, str]]
    question: str
    gold: tuple[int, ...]  # supporting document numbers
    answers: tuple[str, ...]  # the cities
    n_docs: int


def _names(rng: random.Random, count: int) -> list[str]:
    # A dict keeps first-drawn order; a set's order follows per-process string hashing
    # (PYTHONHASHSEED), which made the "same seed" give other prompts in another process.
    names: dict[str, None] = {}
    while len(names) < count:
        names["".join(rng.choice(SYLLABLES) for _ in range(3)).capitalize()] = None
    ordered = list(names)
    rng.shuffle(ordered)
    return ordered


def build_collection(n_docs: int, seed: int = 0) -> list[Document]:
    if n_docs < 3:
        raise ValueError("a citation collection needs at least 3 documents")
    rng = random.Random(seed)
    return [Document(i + 1, name, rng.choice(CITIES), rng.randint(1900, 2020), rng.choice(PRODUCTS)) for i, name in enumerate(_names(rng, n_docs))]


def build_questions(n_docs: int, n_questions: int, *, seed: int = 0, two_doc_share: float = 0.3) -> list[CitationQuestion]:
    """``n_questions`` questions over one collection of ``n_docs`` documents (deterministic)."""
    docs = build_collection(n_docs, seed)
    rng = random.Random(seed + 1)
    example = docs[rng.randrange(n_docs)]
    context = "\n".join(f"Document [{d.number}]: {d.text}" for d in docs)
    candidates = [d for d in docs if d is not example]
    questions = []
    for _ in range(n_questions):
        if rng.random() < two_doc_share:
            a, b = rng.sample(candidates, 2)
            question = f"In which cities were {a.company} and {b.company} founded?"
            gold: tuple[int, ...] = (a.number, b.number)
            answers: tuple[str, ...] = (a.city, b.city)
        else:
            a = rng.choice(candidates)
            question = f"In which city was {a.company} founded?"
            gold, answers = (a.number,), (a.city,)
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{context}\n\nQuestion: In which city was {example.company} founded?"},
            {"role": "assistant", "content": f"{example.company} was founded in {example.city} [{example.number}]."},
            {"role": "user", "content": f"Question: {question}"},
        ]
        questions.append(CitationQuestion(messages, question, gold, answers, n_docs))
    return questions
