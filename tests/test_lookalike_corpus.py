"""The look-alike corpus (issue 66): generated from one seed, shipped as generated, every cue naming
one document, and its domains and cue wordings kept apart from the tuning data and the skim's
head calibration."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from snapkv_rag.adapter_training import compressed_reads, qa_data, tool_data
from snapkv_rag.harness.lookalike_corpus import CUES, generate, write
from snapkv_rag.harness.rag_citation import load_questions
from snapkv_rag.harness.skim_head_reads import CALIBRATION_CUES, calibration_reads
from snapkv_rag.lookalike_world import HELD_OUT_DOMAINS

ROOT = Path(__file__).resolve().parents[1]


def cue_words(template: str) -> list[str]:
    """The fixed wording of a cue template, between its placeholders."""
    return [part.strip() for part in re.split(r"\{[a-z_]+\}", template) if len(part.strip()) > 4]


def cue_pattern(template: str) -> str:
    """A regular expression matching the template's wording whatever fills its placeholders."""
    return ".+?".join(re.escape(part) for part in re.split(r"\{[a-z_]+\}", template))


def test_the_same_seed_gives_the_same_corpus_and_the_shipped_one_is_it(tmp_path):
    docs, questions = generate()
    again_docs, again_questions = generate()
    assert [d.markdown() for d in docs] == [d.markdown() for d in again_docs] and questions == again_questions
    assert generate(7)[1] != questions
    write(tmp_path / "corpus", tmp_path / "questions.jsonl")
    shipped = sorted(p.name for p in (ROOT / "examples/lookalike_corpus").glob("*.md"))
    assert shipped == sorted(p.name for p in (tmp_path / "corpus").glob("*.md"))
    for name in shipped:
        assert (ROOT / "examples/lookalike_corpus" / name).read_text() == (tmp_path / "corpus" / name).read_text()
    assert (ROOT / "examples/lookalike_questions.jsonl").read_text() == (tmp_path / "questions.jsonl").read_text()
    assert len(load_questions(ROOT / "examples/lookalike_questions.jsonl")) == 40


def test_every_cue_names_one_document_of_its_kind_and_that_one_holds_the_answer():
    docs, questions = generate()
    by_file = {d.file: d for d in docs}
    for q in questions:
        gold = by_file[q.gold]
        assert gold.domain in HELD_OUT_DOMAINS
        assert q.answer in gold.text
        cue_value = next(v for v in re.findall(r"\d{4}|\d+:\d\d a\.m\.|[A-Z][a-z]+ [A-Z][a-zA-Z-]+", q.question) if v in gold.text)
        same_kind = [d for d in docs if d.domain == gold.domain and cue_value in d.text]
        assert same_kind == [gold], q.question
    assert len({q.gold for q in questions}) == len(questions)
    assert {q.cue for q in questions} == set(CUES)


@pytest.mark.parametrize("template", list(CUES.values()) + list(CALIBRATION_CUES.values()))
def test_cue_wordings_are_not_in_the_tuning_data(template):
    sources = Path(qa_data.__file__).read_text() + Path(tool_data.__file__).read_text() + Path(compressed_reads.__file__).read_text()
    longest = max(cue_words(template), key=len)  # its distinctive words ("that opened its doors in")
    assert longest not in sources


def test_calibration_reads_use_training_domains_and_other_cue_wordings():
    reads = calibration_reads(6, tokens=1200)
    _, questions = generate()
    for text in [r.question for r in reads]:
        assert not any(re.search(cue_pattern(t), text) for t in CUES.values()), text
    for text in [q.question for q in questions]:
        assert not any(re.search(cue_pattern(t), text) for t in CALIBRATION_CUES.values()), text
    for read in reads:
        assert not any(f"/{domain}/" in c.source for c in read.chunks for domain in HELD_OUT_DOMAINS)
        assert 0 <= read.gold < len(read.chunks)
        assert sum(len(c.text) // 4 for c in read.chunks) >= 1000
    assert len({read.gold for read in reads}) > 1  # the gold document is not always in one place
    assert json.dumps([r.question for r in reads]) == json.dumps([r.question for r in calibration_reads(6, tokens=1200)])
