"""Recipe 4: document QA learned from the cache the toolkit keeps, not from the full one.

Recipe 3 trained every answer against the full K/V of a prompt of at most 4K tokens; the toolkit
reads 2K-16K stuffed tokens through SnapKV (the question's window, 1,024 entries) and rolls
what is past the window. Here an example stuffs 2K-16K tokens of look-alike documents, names
its spec (:attr:`~snapkv_rag.adapter_training.examples.Example.read`), and the trainer
(:func:`compressed_example_loss`) prefills the prompt **without gradients** through the engine's
own decode path (:func:`~snapkv_rag.engine.token_runs.teacher_force_for_training`; the adapter being trained is on, so the
votes and the kept entries are the ones it will meet), then takes gradients on the answer tokens
read against the kept entries, exactly as decoding will read them.

What this does not train: how the prompt's K/V are computed (they carry no gradient). That is the
price of a 16K read at ~30 s without a backward pass on this CPU; the answer tokens' own queries,
keys and MLPs learn to read a cache of a quarter to a sixteenth of the text.

The questions name their entity as recipe 3's do (by name, or ``the {noun} in {town}``), or by a
*cue*, one fact only that document states among a crowd of its kind, in training wordings
(:data:`READ_CUES`) that are neither the look-alike corpus's nor the skim calibration's (a test
checks).
"""

from __future__ import annotations

import random

import torch

from ..lookalike_world import Entity, make_entity
from ..rag.stuffing import build_messages
from .examples import Example
from .qa_data import QAGenerator, answer, question

# The one default compression (snapkv_rag.compression.DEFAULT_COMPRESSION); rolled past ROLL_FROM
# stuffed tokens, and a third of the shorter reads rolled too (the skim always rolls)
ROLLING = 2048
ROLL_FROM = 6000
READ_BUDGETS = (2000, 4000, 8000, 16000)
READ_BUDGET_WEIGHTS = (3, 3, 2, 1)
HELDOUT_MAX_BUDGET = 4000  # the held-out loss probe reads at most this much (it runs twice per training run)
LOOKALIKES = (2, 6)  # documents of the gold's own kind besides it, with its name word or without
CUE_SHARE = 0.5  # questions that name the entity by a cue, not by its name or its town

# How a question names its entity by one fact; wordings of their own (tests/test_lookalike_corpus.py)
READ_CUES: dict[str, str] = {
    "year": "the {noun} founded back in {year}",
    "leader": "the {noun} with {leader} as its {role}",
    "time": "the {noun} that starts weekdays at {time}",
}
CUE_ASKS: dict[str, str] = {
    "place": "In what town is {entity}?",
    "leader": "Who is in charge of {entity}?",
    "year": "What year did {entity} begin?",
}


def read_spec(budget: int, rng: random.Random) -> str:
    """The spec an example of ``budget`` stuffed tokens is read under (stored with the example)."""
    from ..compression import DEFAULT_COMPRESSION

    rolled = budget > ROLL_FROM or rng.random() < 1 / 3
    return (DEFAULT_COMPRESSION.with_rolling(ROLLING) if rolled else DEFAULT_COMPRESSION).spec()


def cue_question(rng: random.Random, entity: Entity) -> tuple[str, str, str]:
    """(question, answer sentence without citation, template id) naming ``entity`` by a cue."""
    cue = rng.choice(sorted(READ_CUES))
    d, f = entity.domain, entity.facts
    named = READ_CUES[cue].format(noun=d.noun, role=d.role, year=f["year"], leader=f["leader"], time=f["time"])
    asked = rng.choice([a for a in (*CUE_ASKS, "measure") if a != cue])
    if asked == "measure":
        text = d.measure_question.format(name=named)
    else:
        text = CUE_ASKS[asked].format(entity=named)
    return text[0].upper() + text[1:], asked, f"read:{cue}:{asked}"


def _clashes(entity: Entity, others: list[Entity]) -> bool:
    """Whether ``entity`` shares a cue fact (or a founding year with a leader's first year) with one of its kind."""
    for other in others:
        if other.domain.key != entity.domain.key:
            continue
        if any(other.facts[k] == entity.facts[k] for k in ("year", "leader", "time", "place")):
            return True
        if str(other.leader_since) == entity.facts["year"] or str(entity.leader_since) == other.facts["year"]:
            return True
    return False


class CompressedReadGenerator(QAGenerator):
    """Draws ``qa_read`` examples: one gold document among look-alikes and fillers up to 2K-16K
    tokens, a question about it, and the spec of the read the trainer runs."""

    chunk_prefix = "read"

    def _entity(self, domain, taken: list[Entity], stem: str | None = None) -> Entity:
        while True:
            entity = make_entity(self.rng, domain, stem=stem)
            if not _clashes(entity, taken) and all(entity.name != t.name for t in taken):
                return entity

    def example(self) -> Example:
        rng = self.rng
        budgets = [b for b in READ_BUDGETS if not self.heldout or b <= HELDOUT_MAX_BUDGET]
        budget = rng.choices(budgets, READ_BUDGET_WEIGHTS[: len(budgets)])[0]
        domain = rng.choice(self.gold_domains)
        gold = self._entity(domain, [])
        entities = [gold]
        for _ in range(rng.randint(*LOOKALIKES)):
            entities.append(self._entity(domain, entities, stem=gold.stem if rng.random() < 0.5 else None))
        chunks = [self._chunk(e) for e in entities]
        used = sum(self.count(c.text) for c in chunks)
        while used < budget:
            filler = self._entity(rng.choice(self.filler_domains), entities)
            entities.append(filler)
            chunks.append(self._chunk(filler))
            used += self.count(chunks[-1].text)
        order = list(range(len(chunks)))
        rng.shuffle(order)
        number = order.index(0) + 1
        if rng.random() < CUE_SHARE:
            q, asked, template = cue_question(rng, gold)
        else:
            described = rng.random() < 0.5 and not any(e.facts["place"] == gold.facts["place"] and e.domain.noun == gold.domain.noun for e in entities[1:])
            q, asked, template = question(rng, gold, self.heldout, described)
        messages, _ = build_messages(q, [chunks[i] for i in order])
        return Example("qa_read", messages, answer(gold, asked, number), domain=domain.key, template=template, read=read_spec(budget, rng))


def compressed_example_loss(model, tokenizer, example: Example, pad_id: int) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy of ``example``'s target read from the cache its :attr:`~Example.read` keeps;
    (loss, target tokens, prompt tokens). The prompt is read by the engine's
    :meth:`~snapkv_rag.engine.generation.DecodeRun.teacher_force` in training mode: the
    prefill without gradients, the answer's tokens through the kept cache with them. The
    first answer token is predicted by the prefill: it counts in the loss but carries no
    gradient."""
    from ..compression import as_policy
    from ..engine.prompts import question_tail_tokens, render_prompt
    from ..engine.token_runs import teacher_force_for_training

    prompt = render_prompt(tokenizer, example.messages)
    targets = tokenizer(example.target + (tokenizer.eos_token or ""), add_special_tokens=False)["input_ids"]
    read = as_policy(example.read)
    if read is None:
        raise ValueError(f"{example.read!r} names no compression to read the prompt under")
    policy = read.for_prompt(question_tail_tokens(tokenizer, example.messages, chat=True))
    logits = teacher_force_for_training(model, prompt, targets, policy, pad_id).float()
    labels = torch.tensor(targets, device=logits.device)
    return torch.nn.functional.cross_entropy(logits, labels), len(targets), len(prompt)
