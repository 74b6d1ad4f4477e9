"""Document-QA examples in DocumentQA's own prompt format (:func:`snapkv_rag.rag.stuffing.build_messages`).

Each prompt stuffs generated documents up to a token budget (0.5K-4K): the gold entity's
document, look-alikes of it (the same name word, other facts), and documents of other
entities. The question's answer is in one document, in two, or in none (then a look-alike of
an absent entity is usually present); the answer states the fact and cites ``[n]``, or says
the documents do not say.

Held out by domain (:data:`~snapkv_rag.lookalike_world.HELD_OUT_DOMAINS`) and by template (the last
question template of each attribute): the training split uses neither, the held-out split
asks only held-out templates about held-out domains.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from ..lookalike_world import DOMAINS, HELD_OUT_DOMAINS, Entity, document_text, make_entity, title
from ..rag.store import StoredChunk
from ..rag.stuffing import build_messages, chunk_segment
from .examples import Example

# attribute -> question templates ({name}, {role}); the last one of each is held out
QUESTIONS: dict[str, tuple[str, ...]] = {
    "year": ("When was {name} founded?", "In what year did {name} open?", "What year was {name} established?", "Since which year has {name} existed?"),
    "place": ("Where is {name}?", "In which town is {name} based?", "Which town is home to {name}?", "Where can I find {name}?"),
    "leader": ("Who is the {role} of {name}?", "Who runs {name}?", "Who has been in charge of {name} as {role}?", "Name the current {role} of {name}."),
    "measure": ("{measure_question}", "According to the documents, {measure_question_lower}", "Quick question: {measure_question_lower}"),
    "feature": ("What is {name} best known for?", "What is {name} famous for?", "What makes {name} well known?"),
    "time": ("What time does {name} open on weekdays?", "When do the doors of {name} open on a weekday?", "At what hour does {name} open on weekdays?"),
}
BUDGETS = (500, 1000, 1500, 2000, 3000, 4000)
BUDGET_WEIGHTS = (3, 4, 3, 3, 1, 1)
KINDS = ("qa_one", "qa_two", "qa_none")
# recipe 3: unanswerable questions were 2 in 10 in recipe 2, and the first adapter then said
# "the documents do not say" to sample questions it could answer (eval/tune/RESULTS.md, issue 47)
KIND_WEIGHTS = (7, 2, 1)
# Share of single questions that describe the entity ("the lighthouse in Quarrow") instead of
# naming it: no document title matches them, so the fact must be found inside a document.
DESCRIBED_SHARE = 0.35


def held_out_template(attribute: str, index: int) -> bool:
    return index == len(QUESTIONS[attribute]) - 1


def template_id(attribute: str, index: int) -> str:
    return f"qa:{attribute}:{index}"


def description(entity: Entity) -> str:
    """The entity as a question may describe it without its name: ``the lighthouse in Quarrow``."""
    return f"the {entity.domain.noun} in {entity.facts['place']}"


def question(rng: random.Random, entity: Entity, heldout: bool, described: bool = False) -> tuple[str, str, str]:
    """(question, attribute, template id) about ``entity``, by name or (``described``, never for
    its place) by :func:`description`."""
    attribute = rng.choice(tuple(a for a in QUESTIONS if not (described and a == "place")))
    templates = QUESTIONS[attribute]
    index = len(templates) - 1 if heldout else rng.randrange(len(templates) - 1)
    name = description(entity) if described else entity.name
    mq = entity.domain.measure_question.format(name=name)
    text = templates[index].format(name=name, role=entity.domain.role, measure_question=mq, measure_question_lower=mq[0].lower() + mq[1:])
    return text, attribute, template_id(attribute, index) + (":described" if described else "")


def answer(entity: Entity, attribute: str, number: int) -> str:
    """One sentence stating the fact, with its citation before the full stop."""
    f, name, cite = entity.facts, entity.name, f" [{number}]."
    if attribute == "year":
        return f"{name} was founded in {f['year']}{cite}"
    if attribute == "place":
        return f"{name} is based in {f['place']}{cite}"
    if attribute == "leader":
        return f"The {entity.domain.role} of {name} is {f['leader']}{cite}"
    if attribute == "measure":
        return entity.domain.measure.format(name=name, value=f["measure"]).rstrip(".") + cite
    if attribute == "time":
        return f"{name} opens at {f['time']} on weekdays{cite}"
    return f"{name} is best known for {f['feature']}{cite}"


def no_answer(entity: Entity, described: bool = False) -> str:
    return f"The documents do not say: none of them is about {description(entity) if described else entity.name}."


class QAGenerator:
    """Draws QA examples; ``count_tokens`` measures a document as the LLM's tokenizer does
    (default: 4 characters a token, so the generator runs without a model)."""

    chunk_prefix = "gen"

    def __init__(self, rng: random.Random, *, heldout: bool = False, count_tokens: Callable[[str], int] | None = None, block_share: float = 0.4):
        self.rng = rng
        self.heldout = heldout
        self.count = count_tokens or (lambda text: len(text) // 4 + 1)
        self.block_share = block_share
        self.gold_domains = [d for d in DOMAINS if (d.key in HELD_OUT_DOMAINS) == heldout]
        # distractors never come from held-out domains in training, nor from training domains' look-alikes in held-out
        self.filler_domains = [d for d in DOMAINS if d.key not in HELD_OUT_DOMAINS] if not heldout else list(DOMAINS)
        self._serial = 0

    def _chunk(self, entity: Entity) -> StoredChunk:
        self._serial += 1
        text = document_text(self.rng, entity)
        return StoredChunk(
            id=f"{self.chunk_prefix}-{self._serial}",
            text=text,
            source=f"generated/{entity.domain.key}/{self._serial}.md",
            title=title(entity),
            position=0,
            tokens=0,
        )

    def example(self) -> Example:
        rng = self.rng
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        budget = rng.choices(BUDGETS, BUDGET_WEIGHTS)[0]
        domain = rng.choice(self.gold_domains)
        golds = [make_entity(rng, domain) for _ in range(2 if kind == "qa_two" else 1)]
        if kind == "qa_two" and rng.random() < 0.5:  # two entities of different domains
            golds[1] = make_entity(rng, rng.choice(self.gold_domains))
        chunks: list[tuple[Entity | None, StoredChunk]] = []
        for gold in golds:
            if kind != "qa_none":
                chunks.append((gold, self._chunk(gold)))
            for _ in range(rng.choice((0, 1, 1, 2))):
                twin = make_entity(rng, gold.domain, stem=gold.stem, avoid=gold)
                chunks.append((None, self._chunk(twin)))
        described = kind != "qa_two" and rng.random() < DESCRIBED_SHARE
        used = sum(self.count(c.text) for _, c in chunks)
        while used < budget:
            filler = make_entity(rng, rng.choice(self.filler_domains))
            if described and filler.domain.noun == golds[0].domain.noun and filler.facts["place"] == golds[0].facts["place"]:
                continue  # it would answer the described question too
            other = self._chunk(filler)
            chunks.append((None, other))
            used += self.count(other.text)
        rng.shuffle(chunks)
        numbers = {id(e): i for i, (e, _) in enumerate(chunks, start=1) if e is not None}
        asked = [question(rng, g, self.heldout, described) for g in golds]
        if kind == "qa_two":
            q = f"{asked[0][0]} Also, {asked[1][0][0].lower()}{asked[1][0][1:]}"
            target = " ".join(answer(g, a[1], numbers[id(g)]) for g, a in zip(golds, asked))
        elif kind == "qa_one":
            q, target = asked[0][0], answer(golds[0], asked[0][1], numbers[id(golds[0])])
        else:
            q, target = asked[0][0], no_answer(golds[0], described)
        stored = [c for _, c in chunks]
        messages, _ = build_messages(q, stored)
        segments = [chunk_segment(c) for c in stored] if rng.random() < self.block_share else []
        return Example(kind, messages, target, segments=segments, domain=domain.key, template="+".join(a[2] for a in asked))
