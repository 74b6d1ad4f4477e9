"""Generated reads that choose a model's skim heads (:func:`snapkv_rag.rag.skim_heads.choose_heads`).

Each read stuffs look-alike documents of one of the tuning world's *training* domains (dozens of
entities of one kind, written from the same sentences) and asks about one of them, naming it by
a fact only its document states, in cue wordings of their own (:data:`CALIBRATION_CUES`): the
look-alike corpus the skim is measured on (:mod:`.lookalike_corpus`: held-out domains and cue
wordings) stays unseen.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from ..lookalike_world import DOMAINS, HELD_OUT_DOMAINS, Entity, document_text, make_entity
from ..rag.skim_heads import CalibrationRead
from ..rag.store import StoredChunk

# How a calibration question names its entity: not the look-alike corpus's wordings (a test checks).
CALIBRATION_CUES: dict[str, str] = {
    "year": "the {noun} established in {year}",
    "leader": "the {noun} run by {leader}",
    "time": "the {noun} whose doors open at {time} on weekdays",
}
ASKS: dict[str, str] = {"place": "Where is {entity}?", "leader": "Who leads {entity}?", "year": "When did {entity} start?"}


def _entities(rng: random.Random, domain) -> Iterator[Entity]:
    """Entities of ``domain`` no two of which share a year, leader or opening time (so a cue
    names one document; there are 42 opening times, so at most 42 of them)."""
    seen: dict[str, set[str]] = {k: set() for k in ("year", "leader", "time")}
    names: set[str] = set()
    for _ in range(10_000):
        e = make_entity(rng, domain)
        if e.name in names or any(e.facts[k] in seen[k] for k in seen):
            continue
        names.add(e.name)
        for k in seen:
            seen[k].add(e.facts[k])
        yield e


def calibration_reads(count: int, *, seed: int = 0, tokens: int = 3000, count_tokens: Callable[[str], int] | None = None) -> list[CalibrationRead]:
    """``count`` look-alike reads of about ``tokens`` document tokens over the training domains."""
    rng = random.Random(seed)
    measure = count_tokens or (lambda text: len(text) // 4 + 1)
    domains = [d for d in DOMAINS if d.key not in HELD_OUT_DOMAINS]
    reads = []
    for i in range(count):
        domain = domains[i % len(domains)]
        chunks: list[StoredChunk] = []
        entities: list[Entity] = []
        used = 0
        for n, entity in enumerate(_entities(rng, domain)):
            entities.append(entity)
            text = document_text(rng, entity).replace("a.m..", "a.m.")
            chunks.append(StoredChunk(id=f"cal-{i}-{n}", text=text, source=f"calibration/{domain.key}/{n}.md", title=entity.name, position=0, tokens=0))
            used += measure(text) + 8
            if used >= tokens:
                break
        order = list(range(len(chunks)))
        rng.shuffle(order)
        gold_entity = rng.randrange(len(chunks))
        cue = rng.choice(sorted(CALIBRATION_CUES))
        asked = rng.choice([a for a in sorted(ASKS) if a != cue])
        entity = entities[gold_entity]
        described = CALIBRATION_CUES[cue].format(noun=domain.noun, year=entity.facts["year"], leader=entity.facts["leader"], time=entity.facts["time"])
        reads.append(CalibrationRead(ASKS[asked].format(entity=described), [chunks[j] for j in order], order.index(gold_entity)))
    return reads
