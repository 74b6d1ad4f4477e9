"""Offline training and held-out text for LESS.

Two sources, both on every machine that runs the toolkit, so training needs no download:

- ``pydoc``: the Python Language Reference topics in ``pydoc_data.topics`` of the running
  Python's standard library (the text ``help()`` shows for keywords and topics), licensed under
  the PSF License Agreement (Python Software Foundation License Version 2), which permits use,
  reproduction and derivative works.
- ``packages``: the long descriptions (READMEs) in the metadata of the installed Python
  distributions, English documentation of many kinds (guides, feature lists, FAQs, changelogs).
  Only distributions whose declared licence is permissive (MIT, BSD, Apache, PSF, ISC) are read;
  copyleft (GPL, LGPL, MPL) or undeclared ones are skipped. Each document's name, version and
  licence are in :func:`manifest`, which training stores in the kernel file.

``mixed`` is both. Documents are split by a stable hash of their key into a training part and a
disjoint held-out part (about one in five). ``pydoc`` keeps its topics in sorted order; the
other texts order documents by the same hash, so the sources interleave along the text and a
window's validation tail holds both.

Debian's ``/usr/share/doc`` was looked at and left out: on this image it is mostly changelogs,
NEWS files and copyright notices, and which packages are there depends on the image.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import LessTrainingError

TEXTS = ("pydoc", "packages", "mixed")
HELDOUT_EVERY = 5
PYDOC_SOURCE = "pydoc_data.topics (Python Language Reference topics, CPython standard library)"
PYDOC_LICENSE = "PSF-2.0 (Python Software Foundation License Version 2)"
PERMISSIVE = ("MIT", "BSD", "APACHE", "PSF", "PYTHON SOFTWARE FOUNDATION", "ISC")
COPYLEFT = ("GPL", "MPL", "MOZILLA", "SHARE", "PROPRIETARY", "COMMERCIAL", "UNKNOWN")
MIN_DOCUMENT_CHARS = 1500
MAX_DOCUMENT_CHARS = 30_000  # a few READMEs carry whole changelogs; keep any one from dominating


@dataclass(frozen=True)
class Document:
    key: str  # a pydoc topic's name, or "packages:<name>": what the split and the order hash
    text: str
    source: str
    version: str
    license: str

    @property
    def split(self) -> str:
        return split_of(self.key)


def split_of(key: str) -> str:
    digest = int(hashlib.sha256(key.encode()).hexdigest(), 16)
    return "heldout" if digest % HELDOUT_EVERY == 0 else "train"


def _order(key: str) -> str:
    return hashlib.sha256(b"order:" + key.encode()).hexdigest()


def pydoc_documents() -> list[Document]:
    from pydoc_data.topics import topics

    return [Document(name, topics[name].strip(), "pydoc", "", PYDOC_LICENSE) for name in sorted(topics)]


def declared_license(metadata) -> str:
    """A distribution's licence as declared: the SPDX expression, else the first line of the
    License field, plus its licence classifiers."""
    parts = [metadata.get("License-Expression") or (metadata.get("License") or "").strip().split("\n")[0][:80]]
    parts += [c.split("::")[-1].strip() for c in metadata.get_all("Classifier") or [] if c.startswith("License ::")]
    return "; ".join(p for p in parts if p)


def is_permissive(license_text: str) -> bool:
    upper = license_text.upper()
    return any(p in upper for p in PERMISSIVE) and not any(c in upper for c in COPYLEFT)


_FENCE = re.compile(r"^\s*(```|~~~)")
_NOISE = re.compile(r"!\[|\.\. (image|figure|raw)::|:target:|:alt:|<img|<a href|<p align|<picture|<source|</?div|</?p>|</?h\d")


def clean_readme(text: str) -> str:
    """The README's prose: fenced code, badges, images and HTML layout lines dropped, blank runs
    collapsed, cut at a paragraph end near :data:`MAX_DOCUMENT_CHARS`."""
    lines, in_fence = [], False
    for line in text.replace("\r\n", "\n").split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence and not _NOISE.search(line):
            lines.append(line.rstrip())
    out = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
    if len(out) > MAX_DOCUMENT_CHARS:
        cut = out.rfind("\n\n", 0, MAX_DOCUMENT_CHARS)
        out = out[: cut if cut > MAX_DOCUMENT_CHARS // 2 else MAX_DOCUMENT_CHARS]
    return out


def package_documents() -> list[Document]:
    """The permissively licensed, non-trivial READMEs of the installed distributions (one per
    name; the first found wins, as on ``sys.path``)."""
    import importlib.metadata as md

    seen, out = set(), []
    for dist in md.distributions():
        meta: Any = dist.metadata  # an email.message.Message: the README is its payload
        name = (meta.get("Name") or "").strip()
        canonical = re.sub(r"[-_.]+", "-", name).lower()
        if not name or canonical in seen or "snapkv" in canonical:  # this project's own READMEs
            continue
        seen.add(canonical)
        license_text = declared_license(meta)
        if not is_permissive(license_text):
            continue
        text = clean_readme(meta.get_payload() or meta.get("Description") or "")
        if len(text) >= MIN_DOCUMENT_CHARS:
            out.append(Document(f"packages:{canonical}", text, "packages", meta.get("Version") or "", license_text))
    return out


def documents(text: str = "pydoc") -> list[Document]:
    """The documents of ``text`` in corpus order."""
    if text == "pydoc":
        return pydoc_documents()
    if text == "packages":
        docs = package_documents()
    elif text == "mixed":  # a topic keeps its key, so it falls in the same split as in "pydoc"
        docs = pydoc_documents() + package_documents()
    else:
        raise LessTrainingError(f"unknown training text {text!r}; choose one of {', '.join(TEXTS)}")
    return sorted(docs, key=lambda d: _order(d.key))


def corpus_text(split: str, text: str = "pydoc") -> str:
    """All documents of ``split`` ("train" or "heldout"), separated by blank lines."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    return "\n\n".join(d.text for d in documents(text) if d.split == split)


def corpus_tokens(tokenizer, split: str, text: str = "pydoc") -> list[int]:
    """The split's text as token ids (no special tokens)."""
    return list(tokenizer(corpus_text(split, text), add_special_tokens=False)["input_ids"])


def manifest(text: str = "pydoc", split: str = "train") -> dict:
    """Where the split's text comes from: per source its licence (pydoc) or each document's
    name, version, licence and size (packages)."""
    docs = [d for d in documents(text) if d.split == split]
    out: dict = {"text": text, "split": split, "chars": sum(len(d.text) for d in docs)}
    if any(d.source == "pydoc" for d in docs):
        out["pydoc"] = {"source": PYDOC_SOURCE, "license": PYDOC_LICENSE, "topics": sum(d.source == "pydoc" for d in docs)}
    packages = [d for d in docs if d.source == "packages"]
    if packages:
        out["packages"] = [{"name": d.key.split(":", 1)[1], "version": d.version, "license": d.license, "chars": len(d.text)} for d in packages]
    return out


def windows(tokens: list[int], length: int, count: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping windows of ``length`` tokens (at most ``count``)."""
    out = [tokens[i : i + length] for i in range(0, len(tokens) - length + 1, length)]
    return out if count is None else out[:count]


def validation_tail(val: int, prompt_lengths: list[int], continuation_tokens: int) -> int:
    """Tokens at the end of the training split that hold the validation windows of every prompt
    length (room for ``val`` windows of the longest); both training stages use the same tail."""
    return val * (max(prompt_lengths) + continuation_tokens)


def overlapping_windows(tokens: list[int], length: int, train: int, val: int, tail: int | None = None) -> tuple[list[list[int]], list[list[int]]]:
    """``train`` windows spread evenly over the text before the last ``tail`` tokens (default
    ``val * length``; training on several window lengths passes the longest length's tail to
    every length, so no training window of any length reaches a validation window), and
    ``val`` non-overlapping windows at the start of that tail."""
    tail = val * length if tail is None else tail
    if tail < val * length:
        raise LessTrainingError(f"a validation tail of {tail} tokens cannot hold {val} windows of {length}")
    start = len(tokens) - tail
    if start < length:
        raise LessTrainingError(f"the training split ({len(tokens)} tokens) is too short for windows of {length} before a {tail}-token validation tail")
    val_windows = windows(tokens[start:], length, val)
    stride = max(1, (start - length) // max(1, train - 1))
    train_windows = [tokens[s : s + length] for s in range(0, start - length + 1, stride)][:train]
    return train_windows, val_windows


def heldout_starts(lengths: Sequence[int], continuation_tokens: int, per_length: int) -> list[int]:
    """Where each prompt's window starts in the held-out split: windows are consecutive in
    ``lengths`` order, so which text a length's prompts are depends on the lengths before it
    (the 4,096-token prompts of ``--lengths 2048,4096`` are not those of ``--lengths 4096``)."""
    starts, start = [], 0
    for length in lengths:
        for _ in range(per_length):
            starts.append(start)
            start += length + continuation_tokens
    return starts


def heldout_prompts(
    tokenizer, lengths: Sequence[int], continuation_tokens: int, per_length: int, text: str = "pydoc"
) -> list[tuple[int, list[int], list[int]]]:
    """``(length, prompt_ids, continuation_ids)`` from consecutive, non-overlapping windows of the
    held-out split of ``text`` (every prompt, of every length, is
    different text; see :func:`heldout_starts`)."""
    tokens = corpus_tokens(tokenizer, "heldout", text)
    out = []
    starts = heldout_starts(lengths, continuation_tokens, per_length)
    for start, length in zip(starts, (n for n in lengths for _ in range(per_length))):
        end = start + length + continuation_tokens
        if end > len(tokens):
            raise ValueError(
                f"the held-out split ({len(tokens)} tokens) is too short for {per_length} prompts of each of {list(lengths)} (+{continuation_tokens}) tokens"
            )
        out.append((length, tokens[start : start + length], tokens[start + length : end]))
    return out
