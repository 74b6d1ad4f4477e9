"""The LESS training texts: sources, licences, splits and the manifest stored with kernels."""

from __future__ import annotations

import pytest

from snapkv_rag.errors import LessTrainingError
from snapkv_rag.less_training.corpus import (
    TEXTS,
    clean_readme,
    corpus_text,
    documents,
    is_permissive,
    manifest,
    package_documents,
)
from snapkv_rag.less_training.train import TrainConfig


@pytest.mark.parametrize(
    ("declared", "permissive"),
    [
        ("MIT", True),
        ("BSD-3-Clause", True),
        ("Apache-2.0; Apache Software License", True),
        ("PSF-2.0", True),
        ("ISC License (ISCL)", True),
        ("MPL-2.0 AND MIT", False),
        ("GPLv2", False),
        ("LGPL-3.0-or-later", False),
        ("", False),
        ("UNKNOWN; MIT License", False),
    ],
)
def test_only_permissive_licences_are_read(declared, permissive):
    assert is_permissive(declared) is permissive


def test_readme_cleaning_keeps_prose_and_drops_code_badges_and_html():
    readme = "\n".join(
        [
            "[![Build](https://ci/badge.svg)](https://ci)",
            "# Widget",
            "",
            "Widget parses timetables.",
            "```python",
            "import widget",
            "```",
            '<p align="center"><img src="logo.png"></p>',
            "",
            "",
            "",
            "It is fast.",
        ]
    )
    assert clean_readme(readme) == "# Widget\n\nWidget parses timetables.\n\nIt is fast."


def test_long_readmes_are_cut_at_a_paragraph_end():
    paragraph = "word " * 200
    text = clean_readme("\n\n".join([paragraph.strip()] * 100))
    assert len(text) <= 30_000 and text.endswith("word")


def test_package_documents_are_permissive_and_leave_out_this_project():
    docs = package_documents()
    assert len(docs) >= 10  # the toolkit's own dependencies have READMEs
    assert all(is_permissive(d.license) and len(d.text) >= 1500 for d in docs)
    assert not any("snapkv" in d.key for d in docs)
    assert len({d.key for d in docs}) == len(docs)


def test_a_document_is_in_the_same_split_in_every_text():
    """Held-out pydoc or package text must stay unseen by kernels trained on "mixed"."""
    mixed = {d.key: d.split for d in documents("mixed")}
    for text in ("pydoc", "packages"):
        for doc in documents(text):
            assert mixed[doc.key] == doc.split
    mixed_train = corpus_text("train", "mixed")
    assert not any(d.text in mixed_train for d in documents("pydoc") if d.split == "heldout")


@pytest.mark.parametrize("text", ["packages", "mixed"])
def test_splits_are_disjoint_by_document(text):
    docs = documents(text)
    held = [d for d in docs if d.split == "heldout"]
    assert held and len(held) < len(docs) / 2
    train_text = corpus_text("train", text)
    for doc in held[:10]:
        assert doc.text not in train_text


def test_mixed_interleaves_both_sources_and_pydoc_is_unchanged():
    sources = [d.source for d in documents("mixed")]
    assert {"pydoc", "packages"} == set(sources)
    first_half = sources[: len(sources) // 2]
    assert "pydoc" in first_half and "packages" in first_half
    assert [d.key for d in documents("pydoc")] == sorted(d.key for d in documents("pydoc"))


def test_manifest_records_each_package_with_its_licence():
    info = manifest("mixed", "train")
    assert info["text"] == "mixed" and info["pydoc"]["license"].startswith("PSF")
    names = {p["name"] for p in info["packages"]}
    assert names and all(p["license"] and p["chars"] >= 1500 for p in info["packages"])
    assert names.isdisjoint({p["name"] for p in manifest("mixed", "heldout")["packages"]})
    assert info["chars"] == len(corpus_text("train", "mixed")) - 2 * (len([d for d in documents("mixed") if d.split == "train"]) - 1)


def test_unknown_text_is_refused():
    with pytest.raises(LessTrainingError, match="pydoc"):
        documents("wikipedia")
    with pytest.raises(LessTrainingError, match="text must be one of"):
        TrainConfig(text="wikipedia").check()
    assert TrainConfig().text == "mixed" and "mixed" in TEXTS


def test_heldout_fidelity_prompts_come_from_the_chosen_text(tokenizer):
    from snapkv_rag.harness.heldout import heldout_prompts

    pydoc = heldout_prompts(tokenizer, [64], 8, 2)
    packages = heldout_prompts(tokenizer, [64], 8, 2, "packages")
    assert [len(p) for _, p, _ in packages] == [64, 64] and [len(c) for _, _, c in packages] == [8, 8]
    assert packages[0][1] != pydoc[0][1]
    from snapkv_rag.less_training.corpus import corpus_tokens

    assert packages[0][1] == corpus_tokens(tokenizer, "heldout", "packages")[:64]
