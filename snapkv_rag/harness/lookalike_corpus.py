"""The look-alike corpus: questions whose evidence the retriever ranks low, so stuffing more must win.

On the sample corpus the top 1,000 tokens of retrieval already hold the answer to most questions,
so stuffing more only adds noise. Here every document is one of many of its kind, written from the
same sentences (:mod:`snapkv_rag.lookalike_world`): dozens of observatories, vineyards, ferry companies,
each with a founding year, a town, a leader, a measure and an opening time. A question names its
entity by a *cue*, one fact only that document states (``the vineyard that opened in 1874``), and
asks another (``How many hectares of vines ...?``). A sentence embedding reads every document of
the kind as about equally close to it, so the gold document lands anywhere in the kind's ranking;
the model, which reads the cue's tokens verbatim in one document, can find it in a long read.

Held apart from training (:mod:`snapkv_rag.adapter_training.qa_data`): the gold documents come from the
held-out domains only, and the cue wordings (:data:`CUES`) are written nowhere in the training
data. Documents of the other domains fill the corpus as distractors.

Everything is drawn from one seed; ``python -m snapkv_rag.harness.lookalike_corpus`` writes the
corpus (one Markdown file a document, ``examples/lookalike_corpus``) and its questions
(``examples/lookalike_questions.jsonl``: ``question``, ``answer``, ``gold``, ``cue``, ``asked``,
the format :func:`~snapkv_rag.harness.rag_citation.load_questions` reads).
"""

from __future__ import annotations

import argparse
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..lookalike_world import DOMAIN_BY_KEY, DOMAINS, HELD_OUT_DOMAINS, Domain, Entity, document_text, make_entity

DEFAULT_SEED = 2026
GOLD_PER_DOMAIN = 24  # documents of each held-out kind: the look-alikes a question's cue must tell apart
DISTRACTOR_DOMAINS = ("hospital", "museum", "bridge", "orchestra", "rail_line", "mine")
DISTRACTORS_PER_DOMAIN = 14
QUESTIONS = 40

# How a question names its entity without its name: a fact only that document states.
# None of these wordings occurs in the tuning data (tests check it).
CUES: dict[str, str] = {
    "year": "the {noun} that opened its doors in {year}",
    "leader": "the {noun} whose {role} is {leader}",
    "time": "the {noun} that opens at {time} on weekdays",
}
# What a question asks about the cued entity, and the answer string an answer must contain.
ASKED: dict[str, str] = {
    "measure": "{measure_question}",
    "place": "Which town is {entity} based in?",
    "leader": "Who is the {role} of {entity}?",
    "year": "In which year was {entity} founded?",
}


@dataclass(frozen=True)
class LookalikeQuestion:
    question: str
    answer: str
    gold: str  # the gold document's file name
    cue: str  # the attribute that names the entity
    asked: str  # the attribute asked about

    def to_dict(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.answer, "gold": self.gold, "cue": self.cue, "asked": self.asked}


@dataclass(frozen=True)
class LookalikeDocument:
    file: str
    title: str
    text: str
    domain: str

    def markdown(self) -> str:
        return f"# {self.title}\n\n{self.text}\n"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _distinct_entities(rng: random.Random, domain: Domain, count: int, names: set[str]) -> list[Entity]:
    """``count`` entities of ``domain``: no two of the kind share a year, town, leader or opening
    time, and no founding year is another's year of a new leader (so a cue's words stand in
    exactly one document of the kind); no document of the corpus shares a name."""
    out: list[Entity] = []
    taken: dict[str, set[str]] = {k: set() for k in ("year", "place", "leader", "time")}
    since: set[str] = set()  # the years leaders took over, which a year cue must not meet either
    while len(out) < count:
        entity = make_entity(rng, domain)
        year, took_over = entity.facts["year"], str(entity.leader_since)
        if entity.name in names or any(entity.facts[k] in taken[k] for k in taken) or year in since or took_over in taken["year"] | {year}:
            continue
        names.add(entity.name)
        for k in taken:
            taken[k].add(entity.facts[k])
        since.add(took_over)
        out.append(entity)
    return out


def cue_phrase(entity: Entity, cue: str) -> str:
    d, f = entity.domain, entity.facts
    return CUES[cue].format(noun=d.noun, role=d.role, year=f["year"], leader=f["leader"], time=f["time"])


def question_for(entity: Entity, cue: str, asked: str) -> tuple[str, str]:
    """(question, answer) asking ``asked`` of the entity named by its ``cue``."""
    described = cue_phrase(entity, cue)
    d, f = entity.domain, entity.facts
    if asked == "measure":
        text = d.measure_question.format(name=described)
    else:
        text = ASKED[asked].format(entity=described, role=d.role)
    return text[0].upper() + text[1:], f[asked]


def generate(seed: int = DEFAULT_SEED, *, questions: int = QUESTIONS) -> tuple[list[LookalikeDocument], list[LookalikeQuestion]]:
    """The corpus's documents (in file order) and its questions, the same for the same seed."""
    rng = random.Random(seed)
    names: set[str] = set()
    gold_entities = {key: _distinct_entities(rng, DOMAIN_BY_KEY[key], GOLD_PER_DOMAIN, names) for key in HELD_OUT_DOMAINS}
    others = [e for key in DISTRACTOR_DOMAINS for e in _distinct_entities(rng, DOMAIN_BY_KEY[key], DISTRACTORS_PER_DOMAIN, names)]
    documents: dict[int, LookalikeDocument] = {}
    for entity in [e for group in gold_entities.values() for e in group] + others:
        file = f"{entity.domain.key.replace('_', '-')}-{_slug(entity.name)}.md"
        text = document_text(rng, entity).replace("a.m..", "a.m.")  # a time ends its sentence
        documents[id(entity)] = LookalikeDocument(file, entity.name, text, entity.domain.key)
    asked_for: list[LookalikeQuestion] = []
    pool = [e for group in gold_entities.values() for e in group]
    rng.shuffle(pool)
    pairs = [(c, a) for c in CUES for a in ASKED if a != c]
    for i, entity in enumerate(pool[:questions]):
        cue, asked = pairs[i % len(pairs)]
        text, answer = question_for(entity, cue, asked)
        asked_for.append(LookalikeQuestion(text, answer, documents[id(entity)].file, cue, asked))
    return sorted(documents.values(), key=lambda d: d.file), asked_for


def write(corpus: Path, questions_file: Path, seed: int = DEFAULT_SEED) -> tuple[int, int]:
    """Write the documents into ``corpus`` (its old ``*.md`` removed) and the questions into
    ``questions_file``; returns (documents, questions)."""
    documents, questions = generate(seed)
    corpus.mkdir(parents=True, exist_ok=True)
    for stale in corpus.glob("*.md"):
        stale.unlink()
    for doc in documents:
        (corpus / doc.file).write_text(doc.markdown())
    questions_file.write_text("".join(json.dumps(q.to_dict()) + "\n" for q in questions))
    return len(documents), len(questions)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m snapkv_rag.harness.lookalike_corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=Path("examples/lookalike_corpus"), help="folder for the documents")
    parser.add_argument("--questions", type=Path, default=Path("examples/lookalike_questions.jsonl"))
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    documents, questions = write(args.corpus, args.questions, args.seed)
    print(f"{documents} documents in {args.corpus}, {questions} questions in {args.questions}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = ["CUES", "DOMAINS", "LookalikeDocument", "LookalikeQuestion", "generate", "write"]
