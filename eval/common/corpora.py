"""The corpora the benchmarks answer questions over: the sample corpus, the look-alike corpus and a generated one."""

from __future__ import annotations

import random
from pathlib import Path

from snapkv_rag.harness.rag_citation import RagQuestion, load_questions

ROOT = Path(__file__).resolve().parents[2]

CORPORA = ("sample", "lookalike", "generated", "needles")
VAULTS = ["red", "blue", "green", "amber", "violet", "silver", "golden", "white"]


PLACES = [
    "ferry terminal",
    "weather station",
    "archive",
    "tram depot",
    "lighthouse",
    "market hall",
    "seed bank",
    "clock tower",
    "water works",
    "radio mast",
    "boat yard",
    "glass studio",
]
PEOPLE = ["Ada Quill", "Bram Osei", "Cora Lindqvist", "Dev Anand", "Elin Marsh", "Faisal Noor", "Greta Holm", "Hugo Varga"]


def generated_corpus(folder: Path, documents: int = 120, seed: int = 0) -> list[RagQuestion]:
    """``documents`` short reports about numbered sites, each with one unique code; a question per document."""
    rng = random.Random(seed)
    questions = []
    for i in range(documents):
        place = f"{PLACES[i % len(PLACES)]} {i // len(PLACES) + 1}"
        code = f"{rng.choice('KMRTVX')}{rng.randint(100, 999)}"
        keeper = rng.choice(PEOPLE)
        opened = rng.randint(1890, 2015)
        filler = " ".join(
            f"Inspectors visited the {place} in {opened + k} and noted {rng.choice(['fresh paint', 'a new roof', 'repaired stairs', 'clean filters', 'a longer jetty'])}."
            for k in range(6)
        )
        text = (
            f"# Report on the {place}\n\nThe {place} opened in {opened} and is kept by {keeper}. {filler} "
            f"The access code of the {place} is {code}. Visitors sign the book at the gate.\n"
        )
        (folder / f"site-{i:03d}.md").write_text(text)
        questions.append(RagQuestion(f"What is the access code of the {place}?", code, [f"site-{i:03d}.md"]))
    return questions


def needles_corpus(folder: Path, units: int = 170, seed: int = 0) -> list[RagQuestion]:
    """One haystack of about 3,500 tokens (the pass-key filler, each repeat in its own order) holding
    eight pass keys, one per vault, at evenly spaced depths; a question per vault."""
    from snapkv_rag.harness.needle import FILLER_SENTENCES, make_passkey

    rng = random.Random(seed)
    fill = ["".join(" " + s for s in rng.sample(FILLER_SENTENCES, len(FILLER_SENTENCES))) for _ in range(units)]
    questions = []
    for i, vault in enumerate(VAULTS):
        key = make_passkey(seed * 100 + i)
        at = round((i + 1) * units / (len(VAULTS) + 1)) + i
        fill.insert(at, f"\nIMPORTANT: the pass key of the {vault} vault is {key}.\n")
        questions.append(RagQuestion(f"What is the pass key of the {vault} vault?", key, ["vaults.txt"]))
    (folder / "vaults.txt").write_text("".join(fill).strip() + "\n")
    return questions


def load_corpus(name: str, scratch: Path, questions: int | None = None) -> tuple[Path, list[RagQuestion]]:
    """``(folder to ingest, questions)``: ``sample`` is examples/sample_corpus with its 40 questions,
    ``lookalike`` examples/lookalike_corpus with its 40 (:mod:`snapkv_rag.harness.lookalike_corpus`);
    ``generated`` writes 120 site reports under ``scratch`` and takes ``questions`` of them evenly;
    ``needles`` writes one haystack with eight pass keys (:func:`needles_corpus`)."""
    if name in ("sample", "lookalike"):
        return ROOT / f"examples/{name}_corpus", load_questions(ROOT / f"examples/{name}_questions.jsonl", questions)
    folder = scratch / "corpus"
    folder.mkdir(parents=True, exist_ok=True)
    if name == "needles":
        return folder, needles_corpus(folder)[:questions]
    return folder, generated_corpus(folder)[:: max(1, 120 // (questions or 120))][:questions]
